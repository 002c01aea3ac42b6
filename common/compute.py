"""The one thread that runs a service's tensor work.

OpenMP (torch's intra-op parallelism, and the compiled CPU kernels) keeps a team of worker
threads for every thread that starts a parallel region. Once its teams hold more threads
than there are cores, libgomp stops spinning between regions (its throttled spin count), so
every region pays a futex wake-up: on 2 cores, a decode step run by a pool's changing
worker threads after the weights were loaded on the main thread took 33 ms against 24 ms
on the main thread (a 1024 x 1024 linear: 107 against 28 us). So a service loads on its
main thread, releases that thread's team (`moe_kernels.cpu_kernels.release_threads`), and
runs every step on one `ComputeThread`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ComputeThread:
    """One long-lived worker thread; `run` awaits a call on it from the event loop."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """fn(*args) on the thread. Cancelled, the caller stops waiting; a call that has
        started runs to its end (as `anyio.to_thread.run_sync(abandon_on_cancel=True)`)."""
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
