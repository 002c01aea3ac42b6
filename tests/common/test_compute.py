"""`common.compute.ComputeThread`: every call on the same one thread, results and errors
returned to the awaiting task, a cancelled wait that leaves the call running, and the
service's busy and waiting time."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
from prometheus_client import REGISTRY

from common.compute import BUSY_WINDOW, BusyClock, ComputeThread, waiting
from moe_kernels.cpu_kernels import cpu_kernels, release_threads


def test_every_call_runs_on_one_thread_and_returns_or_raises() -> None:
    compute = ComputeThread("test-compute", "test")

    async def main() -> None:
        threads = {await compute.run(threading.get_ident) for _ in range(20)}
        assert len(threads) == 1 and threading.get_ident() not in threads
        assert await compute.run(pow, 2, 10) == 1024
        with pytest.raises(ZeroDivisionError):
            await compute.run(lambda: 1 / 0)

    try:
        anyio.run(main)
    finally:
        compute.close()


def test_a_cancelled_wait_leaves_the_call_to_finish() -> None:
    compute = ComputeThread("test-compute", "test")
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        release.wait(10)
        finished.set()

    async def main() -> None:
        scope = anyio.CancelScope()

        async def wait() -> None:
            with scope:
                await compute.run(work)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            assert await anyio.to_thread.run_sync(started.wait, 10)
            scope.cancel()
        assert not finished.is_set()  # the wait ended, not the call
        release.set()
        assert await compute.run(finished.is_set)  # the next call runs after it

    try:
        anyio.run(main)
    finally:
        compute.close()


def test_releasing_the_openmp_team_leaves_later_regions_working() -> None:
    import torch

    assert cpu_kernels() is not None  # loaded: release only ever frees, never builds
    x = torch.randn(256, 4096)
    before = x.sum()
    release_threads()
    torch.testing.assert_close(x.sum(), before)  # a new team, on first use


def test_busy_time_is_the_thread_s_work_less_its_waits() -> None:
    """A call that works and waits: busy counts only the work, waiting the waits; the
    busy fraction of the window is the work's share."""
    clock = BusyClock("test-busy")
    labels = {"service": "test-busy"}

    def work_and_wait() -> None:
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:  # work
            pass
        with waiting():
            time.sleep(0.1)  # an answer from another service

    busy0 = REGISTRY.get_sample_value("switchyard:busy_seconds_total", labels) or 0.0
    wait0 = REGISTRY.get_sample_value("switchyard:wait_seconds_total", labels) or 0.0
    clock.timed(work_and_wait)
    busy = REGISTRY.get_sample_value("switchyard:busy_seconds_total", labels) - busy0
    wait = REGISTRY.get_sample_value("switchyard:wait_seconds_total", labels) - wait0
    assert 0.05 <= busy < 0.09 and 0.1 <= wait < 0.14
    fraction = REGISTRY.get_sample_value("switchyard:busy_fraction", labels)
    assert fraction == pytest.approx(busy / BUSY_WINDOW, rel=0.05)
    assert clock.fraction(time.monotonic() + BUSY_WINDOW + 1) == 0.0  # out of the window
