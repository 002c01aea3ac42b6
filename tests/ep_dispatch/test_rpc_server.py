"""The `rpc` backend's expert side (`ep_dispatch/rpc_server.py`) on loopback, in this
process: the handshake, and batches of one layer that queue up from several connections
while a computation runs, answered by one call."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
import torch

from common.messages import (
    ExpertBatch,
    ExpertInfo,
    ExpertResult,
    InfoRequest,
    PlacementReady,
    PlacementUpdate,
    UsePlacement,
)
from common.rpc import connect
from ep_dispatch.rpc_server import RpcListen, serve_rpc
from ep_dispatch.wire import to_wire

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _batch(call_id: int, layer: int, version: int = 0) -> ExpertBatch:
    return ExpertBatch(call_id, layer, [0], to_wire(torch.zeros(0, 4)), version=version)


def _no_load(update: PlacementUpdate) -> PlacementReady:
    raise AssertionError("no placement is loaded here")


async def test_batches_of_a_layer_that_queue_up_are_answered_by_one_call() -> None:
    calls: list[list[int]] = []
    started, release = threading.Event(), threading.Event()

    def answer(batches: list[ExpertBatch]) -> list[ExpertResult]:
        calls.append([b.call_id for b in batches])
        started.set()
        release.wait(30)  # the first computation runs until every other batch has queued
        return [ExpertResult(b.call_id, error=f"layer {b.layer}") for b in batches]

    info = ExpertInfo(0, 1, {0: [0]}, 0, None)
    bound: list[int] = []
    ready = anyio.Event()

    def on_ready(port: int) -> None:
        bound.append(port)
        ready.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_rpc, RpcListen("127.0.0.1", 0, answer, lambda: info, _no_load,
                                           lambda _: None), on_ready)
        await ready.wait()
        a, b = [await connect("127.0.0.1", bound[0]) for _ in range(2)]
        await a.send(InfoRequest())
        assert await a.receive() == info
        await a.send(_batch(1, 0))
        await anyio.to_thread.run_sync(started.wait, 30)
        await a.send(_batch(2, 0))  # queued behind call 1, with b's two
        await b.send(_batch(3, 5))  # another layer: its own call, after
        await b.send(_batch(4, 0))
        for conn in (a, b):  # a connection's frames are handled in order: once its
            await conn.send(InfoRequest())  # handshake is answered, its batches queued
            assert await conn.receive() == info
        queued = time.perf_counter()
        release.set()
        released = time.perf_counter()
        got_a = [await a.receive() for _ in range(2)]
        got_b = [await b.receive() for _ in range(2)]
        tg.cancel_scope.cancel()
    assert calls == [[1], [2, 4], [3]]
    assert [(r.call_id, r.error) for r in got_a] == [(1, "layer 0"), (2, "layer 0")]
    assert sorted((r.call_id, r.error) for r in got_b) == [(3, "layer 5"), (4, "layer 0")]
    # each answer says how long it was held: from its arrival (before `queued`) until
    # it went out (after the release), which the attention side takes off its round trip
    assert all(r.held_s >= released - queued for r in got_a + got_b)


async def test_a_taken_port_is_named() -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port}: "):
            await serve_rpc(RpcListen("127.0.0.1", port, list, lambda: None,  # type: ignore
                                      _no_load, lambda _: None), lambda _: None)


async def test_placement_versions_load_beside_layer_calls_and_are_released() -> None:
    """A rebalance's load runs while layer calls are answered; batches of one layer but
    two placement versions are two calls; `release` hears the versions the connections
    use whenever that set changes (a connection that closes uses none)."""
    calls: list[list[tuple[int, int]]] = []
    released: list[set[int]] = []
    loading, loaded = threading.Event(), threading.Event()

    def answer(batches: list[ExpertBatch]) -> list[ExpertResult]:
        calls.append([(b.call_id, b.version) for b in batches])
        return [ExpertResult(b.call_id) for b in batches]

    def prepare(update: PlacementUpdate) -> PlacementReady:
        loading.set()
        loaded.wait(30)  # held until a layer call was answered meanwhile
        return PlacementReady(update.version, 0, {0: [0, 1]})

    info = ExpertInfo(0, 1, {0: [0]}, 0, None)
    bound: list[int] = []
    ready = anyio.Event()

    def on_ready(port: int) -> None:
        bound.append(port)
        ready.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_rpc, RpcListen("127.0.0.1", 0, answer, lambda: info, prepare,
                                           released.append), on_ready)
        await ready.wait()
        a, b = [await connect("127.0.0.1", bound[0]) for _ in range(2)]
        await a.send(UsePlacement(0))
        await a.send(PlacementUpdate(1, "{}"))
        await anyio.to_thread.run_sync(loading.wait, 30)
        await a.send(_batch(1, 0))
        assert (await a.receive()).call_id == 1  # answered while the load runs
        loaded.set()
        assert await a.receive() == PlacementReady(1, 0, {0: [0, 1]})
        await b.send(_batch(2, 0, version=1))
        assert (await b.receive()).call_id == 2
        await a.send(UsePlacement(1))
        await a.send(InfoRequest())  # (frames in order: the switch is handled by now)
        assert await a.receive() == info
        await b.aclose()
        await a.aclose()
        with anyio.fail_after(10):
            while len(released) < 4:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert calls == [[(1, 0)], [(2, 1)]]
    assert released == [{0}, {0, 1}, {1}, set()]
