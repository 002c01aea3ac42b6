"""`common.compute.ComputeThread`: every call on the same one thread, results and errors
returned to the awaiting task, and a cancelled wait that leaves the call running."""

from __future__ import annotations

import threading

import anyio
import pytest

from common.compute import ComputeThread
from moe_kernels.cpu_kernels import cpu_kernels, release_threads


def test_every_call_runs_on_one_thread_and_returns_or_raises() -> None:
    compute = ComputeThread("test-compute")

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
    compute = ComputeThread("test-compute")
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
