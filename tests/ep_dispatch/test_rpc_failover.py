"""The rpc client routing around a lost expert rank, against expert ranks that fail in
the ways real ones do at the protocol level: dying in the middle of an answer, answering
garbage, refusing connections. (Whole expert services killed and restarted:
tests/e2e/test_expert_services.py and tests/e2e/test_compose.py.)"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from functools import partial

import anyio
import pytest
import torch
from anyio.abc import SocketAttribute, SocketStream
from anyio.from_thread import start_blocking_portal

from common.auth import NO_SECRET
from common.messages import ExpertBatch, ExpertInfo, ExpertResult, InfoRequest
from common.rpc import _HEADER, FrameStream, _encoder, accept
from ep_dispatch.placement import Placement
from ep_dispatch.rpc import RpcExperts
from ep_dispatch.wire import from_wire, to_wire
from tests.support.tools import wait_until

HIDDEN = 8
PLACEMENT = Placement.balanced([0], 4, 2, replicas=2)  # every expert on both ranks


async def answer(fake: FakeRank, conn: FrameStream, stream: SocketStream,
                 batch: ExpertBatch) -> bool:
    """The rows times (rank + 1), so that a test sees who answered; True: carry on."""
    y = from_wire(batch.x) * (fake.rank + 1)
    await conn.send(ExpertResult(batch.call_id, to_wire(y)))
    return True


async def die_mid_answer(fake: FakeRank, conn: FrameStream, stream: SocketStream,
                         batch: ExpertBatch) -> bool:
    """Half an answer's frame, then the connection closes (a process killed mid-send);
    its handshakes fail from then on (the next `revive_after` of them, if set)."""
    fake.garbled = fake.revive_after
    payload = _encoder.encode(ExpertResult(batch.call_id, to_wire(from_wire(batch.x))))
    await stream.send(_HEADER.pack(len(payload)) + payload[:len(payload) // 2])
    fake.behaviour = answer
    return False


async def slow_answer(fake: FakeRank, conn: FrameStream, stream: SocketStream,
                      batch: ExpertBatch) -> bool:
    """`answer`, a while later (after a faster rank failed)."""
    await anyio.sleep(0.3)
    return await answer(fake, conn, stream, batch)


async def wedged(fake: FakeRank, conn: FrameStream, stream: SocketStream,
                 batch: ExpertBatch) -> bool:
    """Computation stuck: no batch is ever answered, though handshakes still are (they
    are answered on the service's event loop, the computation runs in a thread)."""
    await anyio.sleep_forever()
    return False


async def garbage_answer(fake: FakeRank, conn: FrameStream, stream: SocketStream,
                         batch: ExpertBatch) -> bool:
    """A whole frame whose bytes are no message; then it answers properly."""
    await stream.send(_HEADER.pack(3) + b"\xc1\xc1\xc1")
    fake.behaviour = answer
    return False


Behaviour = Callable[["FakeRank", FrameStream, SocketStream, ExpertBatch], Awaitable[bool]]


class FakeRank:
    """An expert rank on loopback, on its own event loop: answers handshakes (the next
    `garbled` of them with bytes that are no message) and batches by `behaviour`."""

    def __init__(self, rank: int, behaviour: Behaviour = answer) -> None:
        self.rank, self.behaviour, self.garbled, self.batches = rank, behaviour, 0, 0
        self.revive_after = 10**9  # failed handshakes once it died (`die_mid_answer`)
        self._cm = start_blocking_portal()
        self._portal = self._cm.__enter__()
        listener = self._portal.call(partial(anyio.create_tcp_listener,
                                             local_host="127.0.0.1"))
        self.address = ("127.0.0.1", listener.extra(SocketAttribute.local_port))
        self._portal.start_task_soon(listener.serve, self._handle)

    async def _handle(self, stream: SocketStream) -> None:
        conn = await accept(stream, NO_SECRET, "a test", logging.getLogger(__name__))
        if conn is None:
            return
        async with stream:
            while True:
                try:
                    msg = await conn.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
                if isinstance(msg, InfoRequest) and self.garbled:
                    self.garbled -= 1
                    await stream.send(_HEADER.pack(3) + b"\xc1\xc1\xc1")
                    return
                if isinstance(msg, InfoRequest):
                    await conn.send(ExpertInfo(self.rank, 2,
                                               PLACEMENT.local_experts(self.rank), 0))
                elif isinstance(msg, ExpertBatch):
                    self.batches += 1
                    if not await self.behaviour(self, conn, stream, msg):
                        return

    def close(self) -> None:
        self._portal.call(self._portal.stop, True)
        self._cm.__exit__(None, None, None)


@contextmanager
def client(*behaviours: Behaviour, call_timeout: float = 10
           ) -> Iterator[tuple[RpcExperts, list[FakeRank]]]:
    ranks: list[FakeRank] = []
    try:
        ranks += [FakeRank(r, b) for r, b in enumerate(behaviours)]
        experts = RpcExperts(PLACEMENT, [r.address for r in ranks], call_timeout=call_timeout)
        try:
            yield experts, ranks
        finally:
            experts.close()
    finally:
        for rank in ranks:
            rank.close()


def layer_call(experts: RpcExperts) -> torch.Tensor:
    x = torch.randn(6, HIDDEN)
    ids = torch.zeros(6, 1, dtype=torch.int64)  # expert 0: its replicas take turns
    return experts(0, x, ids, torch.ones(6, 1)) / x  # [6, H]: who answered, per token


def test_a_rank_that_dies_mid_answer_is_routed_around() -> None:
    """Its connection ends inside a frame: the rank is lost like one that closed, and
    the layer call is made again on the replicas."""
    with client(answer, die_mid_answer) as (experts, ranks):
        scale = layer_call(experts)
        assert experts.pool.lost == {1} and ranks[1].batches == 1
        assert torch.allclose(scale, torch.ones_like(scale))  # all from rank 0 (x1)


def test_the_ranks_that_answered_keep_their_connections() -> None:
    """A failed call no longer cancels the others: their connections (which a cancelled
    call must close, a late answer may be on the way) serve the call made again."""
    with client(slow_answer, die_mid_answer) as (experts, _):
        before = experts.pool.conns[0]
        scale = layer_call(experts)
        assert experts.pool.lost == {1} and experts.pool.conns[0] is before is not None
        assert torch.allclose(scale, torch.ones_like(scale))  # all from rank 0 (x1)


def test_a_probe_that_meets_garbage_keeps_probing(caplog: pytest.LogCaptureFixture) -> None:
    """A rank whose first probes get bytes that are no message (another program on its
    port, a rank restarting) is still probed, and comes back once it answers."""
    with client(answer, die_mid_answer) as (experts, ranks):
        ranks[1].revive_after = 2  # once dead, its next two handshakes get garbage
        layer_call(experts)
        wait_until(lambda: not experts.pool.lost, 30, lambda: f"rank 1 back: {experts.pool.lost}")
        assert "is still lost" in caplog.text  # said why, once per reason
        scale = layer_call(experts)
        assert set(scale[:, 0].tolist()) == {1.0, 2.0}  # both ranks answer again


def test_a_layer_call_crosses_no_thread() -> None:
    """The exchange runs on the caller's thread (the engine's step thread): every frame of
    a layer call is sent and read there, with no thread started, also when a rank is lost
    and the call is made again on its replicas (only its probe runs beside it)."""
    import threading

    from common.rpc import SocketFrames

    with client(answer, die_mid_answer) as (experts, _):
        where: list[int] = []
        send, receive = SocketFrames.send, SocketFrames.receive

        def sending(self: SocketFrames, message: object, deadline: float) -> int:
            where.append(threading.get_ident())
            return send(self, message, deadline)  # type: ignore[arg-type]

        def receiving(self: SocketFrames, deadline: float) -> object:
            where.append(threading.get_ident())
            return receive(self, deadline)

        started = threading.Thread.start
        threads: list[str] = []

        def start(self: threading.Thread) -> None:
            threads.append(self.name)
            started(self)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(SocketFrames, "send", sending)
            patch.setattr(SocketFrames, "receive", receiving)
            patch.setattr(threading.Thread, "start", start)
            layer_call(experts)
        mine = [w for w in where if w == threading.get_ident()]
        assert len(mine) >= 4  # both ranks' sends and reads, then rank 0's again
        assert threads == ["_probe expert rank 1"]  # lost: probed beside the calls
        assert experts.pool.lost == {1}


def test_a_rank_whose_computation_is_stuck_stays_routed_around() -> None:
    """It answers handshakes but no batch: once a call timed out on it, it is back in
    the routing only when it answers an empty layer call, so no later call waits on it
    (each did, a whole call timeout, when a handshake alone brought it back)."""
    import time

    with client(answer, wedged, call_timeout=1.0) as (experts, _):
        layer_call(experts)  # the replicas share the tokens: rank 1 times out
        assert experts.pool.lost == {1}
        end = time.monotonic() + 3.0  # three probes' worth
        while time.monotonic() < end:
            started = time.monotonic()
            scale = layer_call(experts)
            assert time.monotonic() - started < 0.5
            assert torch.allclose(scale, torch.ones_like(scale))  # all rank 0's
        assert experts.pool.lost == {1}


def test_a_rank_answering_garbage_is_routed_around() -> None:
    """Bytes that are no message, in a whole frame: lost like a dropped rank (it used to
    fail the step with a decode error), and back once it answers properly."""
    with client(answer, garbage_answer) as (experts, ranks):
        scale = layer_call(experts)  # the replicas share the tokens: rank 1 gets some
        assert ranks[1].batches >= 1  # (then the probe's empty call, maybe)
        assert torch.allclose(scale, torch.ones_like(scale))  # made again on rank 0
        wait_until(lambda: not experts.pool.lost, 30, lambda: f"rank 1 back: {experts.pool.lost}")
        assert set(layer_call(experts)[:, 0].tolist()) == {1.0, 2.0}


def test_a_dropped_rank_without_replicas_is_ready_again_without_traffic() -> None:
    """No replica, and the rank is not back when the held step tries it (its first
    handshake fails): the call fails, as its step does. Readiness then connects the rank
    again in the background, so /health (503 meanwhile) recovers without a request, which
    a load balancer that saw the 503 would not send."""
    from ep_dispatch.rpc_pool import ExpertRankError

    ranks = [FakeRank(0, die_mid_answer)]
    ranks[0].revive_after = 1  # the held step's handshake fails; the next ones work
    experts = RpcExperts(Placement.balanced([0], 4, 1), [ranks[0].address], call_timeout=10)
    try:
        with pytest.raises(ExpertRankError):
            experts(0, torch.randn(3, HIDDEN), torch.zeros(3, 1, dtype=torch.int64),
                    torch.ones(3, 1))
        assert ranks[0].batches == 1 and not experts.pool.lost
        wait_until(experts.ready, 30, lambda: "rank 0 connected again")
        assert ranks[0].batches == 1  # by its handshake alone: no layer call was made
        y = experts(0, torch.ones(3, HIDDEN), torch.zeros(3, 1, dtype=torch.int64),
                    torch.ones(3, 1))
        assert torch.equal(y, torch.ones(3, HIDDEN))  # rank 0 answers x * 1
    finally:
        experts.close()
        ranks[0].close()
