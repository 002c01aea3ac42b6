"""The one thread that runs a service's tensor work.

OpenMP, which runs torch's intra-op parallelism and the compiled CPU kernels, keeps a team
of worker threads for every thread that starts a parallel region. Once its teams hold more
threads than there are cores, libgomp stops spinning between regions (its throttled spin
count), so every region pays a futex wake-up. On 2 cores, a decode step run by a pool's
changing worker threads, after the weights were loaded on the main thread, took 33 ms
against 24 ms on the main thread; a 1024 x 1024 linear took 107 against 28 us. So a service
loads on its main thread, releases that thread's team
(`moe_kernels.cpu_kernels.release_threads`), and runs every step on one `ComputeThread`.

That thread's time is the service's busy time (`switchyard:busy_seconds_total`), less what
its work waited on other services (`waiting`, `switchyard:wait_seconds_total`), as when an
attention service is blocked on its expert services' answers. `switchyard:busy_fraction` is
the busy share of the last `BUSY_WINDOW` seconds. The ping-pong pipeline is judged by these:
both sides should be busy at once, and the waits are its bubbles.

The attention service runs every step on this thread, and the `rpc` expert side runs its
computations on one too; the attention service's thread also makes each layer's exchange
with the experts itself.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

from prometheus_client import Counter, Gauge

T = TypeVar("T")
BUSY_WINDOW = 10.0  # seconds `switchyard:busy_fraction` looks back
_BUSY = Counter("switchyard:busy_seconds", "Seconds this service computed: its compute "
                "thread's work, less that work's waits on other services.", ["service"])
_WAIT = Counter("switchyard:wait_seconds", "Seconds this service's compute thread waited on "
                "other services' answers (a pipeline's bubbles).", ["service"])
_FRACTION = Gauge("switchyard:busy_fraction", f"Busy share of the last {BUSY_WINDOW:.0f} s "
                  "(switchyard:busy_seconds over wall time).", ["service"])
_waits = threading.local()


@contextmanager
def waiting() -> Iterator[None]:
    """Time the calling thread spends here, as on an exchange's answers, is a wait, not
    work."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _waits.seconds = getattr(_waits, "seconds", 0.0) + time.perf_counter() - start


def waited() -> float:
    """Seconds the current call on this thread has waited so far (`waiting`)."""
    return getattr(_waits, "seconds", 0.0)


class BusyClock:
    """One service's busy and waiting seconds, and its busy share of a recent window."""

    def __init__(self, service: str) -> None:
        self._busy, self._wait = _BUSY.labels(service), _WAIT.labels(service)
        self._recent: deque[tuple[float, float, float]] = deque()  # (start, end, waited)
        self._lock = threading.Lock()
        _FRACTION.labels(service).set_function(self.fraction)

    def timed(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args), its time counted as busy except its waits."""
        _waits.seconds = 0.0
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            end, wait = time.monotonic(), waited()
            self._busy.inc(max(0.0, end - start - wait))
            self._wait.inc(wait)
            with self._lock:
                self._recent.append((start, end, wait))

    def fraction(self, now: float | None = None) -> float:
        """Busy seconds within the last `BUSY_WINDOW`, over the window. A call's waits are
        spread evenly over it."""
        now = time.monotonic() if now is None else now
        since = now - BUSY_WINDOW
        busy = 0.0
        with self._lock:
            while self._recent and self._recent[0][1] <= since:
                self._recent.popleft()
            for start, end, wait in self._recent:
                inside = min(end, now) - max(start, since)
                if inside > 0:
                    busy += inside * (1 - wait / (end - start)) if end > start else 0.0
        return min(1.0, busy / BUSY_WINDOW)


class ComputeThread:
    """One long-lived worker thread; `run` awaits a call on it from the event loop."""

    def __init__(self, name: str, service: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.clock = BusyClock(service)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on the thread, its time counted as the service's busy time
        (`BusyClock`). When cancelled, the caller stops waiting, but a call that has started
        runs to its end, as with `anyio.to_thread.run_sync(abandon_on_cancel=True)`."""
        return await self.start(fn, *args)

    def start(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """`run`, started now: await the future for its result."""
        return asyncio.wrap_future(self._executor.submit(self.clock.timed, fn, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
