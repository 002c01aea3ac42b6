"""The `rpc` backend's client (`ep_dispatch/rpc.py`) against scripted expert servers on
loopback: a rank that fails or goes away costs that step, never the connections to the
others, and a rank that comes back is used again."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import pytest
import torch
from anyio.abc import SocketAttribute, SocketStream
from anyio.from_thread import start_blocking_portal
from hypothesis import given
from hypothesis import strategies as st

from common.auth import NO_SECRET
from common.messages import (
    ExpertBatch,
    ExpertInfo,
    ExpertResult,
    InfoRequest,
    PlacementReady,
    PlacementUpdate,
    UsePlacement,
)
from common.rpc import FrameStream, accept
from ep_dispatch.placement import Placement
from ep_dispatch.rpc import RpcExperts
from ep_dispatch.rpc_pool import ExpertRankError
from ep_dispatch.wire import from_wire, to_wire

pytestmark = pytest.mark.timeout(60)
PLACEMENT = Placement.balanced([0], 4, 2)  # experts 0, 2 on rank 0; 1, 3 on rank 1
# (rank, number of the batch on that rank, counting from 0) -> what the rank does:
# "ok" answers x * 2, "reject" answers an error, "slow" answers late, "drop" hangs up.
Script = Callable[[int, int], str]


@contextmanager
def expert_servers(script: Script, seen: list[tuple[int, object]] | None = None
                   ) -> Iterator[list[tuple[str, int]]]:
    """Two scripted expert ranks in a thread of their own; their addresses. They load
    any placement version asked for ("refuse": rank 1 refuses), and note in `seen` each
    `UsePlacement` and batch (rank, (version, layer, tokens per local expert))."""
    batches = [0, 0]
    shares = {0: {r: PLACEMENT.local_experts(r) for r in range(2)}}

    async def handle(rank: int, conn: FrameStream) -> None:
        try:
            while True:
                msg = await conn.receive()
                if isinstance(msg, InfoRequest):
                    await conn.send(ExpertInfo(rank, 2, PLACEMENT.local_experts(rank), 0,
                                               shares={v: s[rank] for v, s in shares.items()}))
                    continue
                if isinstance(msg, UsePlacement):
                    (seen if seen is not None else []).append((rank, msg))
                    continue
                if isinstance(msg, PlacementUpdate):
                    placement = Placement.from_json(msg.placement, [0], 4)
                    if rank == 1 and script(rank, -1) == "refuse":
                        await conn.send(PlacementReady(msg.version, rank, error="no room"))
                        continue
                    shares.setdefault(msg.version, {})[rank] = placement.local_experts(rank)
                    await conn.send(PlacementReady(msg.version, rank,
                                                   placement.local_experts(rank), load_s=0.1))
                    continue
                assert isinstance(msg, ExpertBatch)
                if seen is not None:
                    seen.append((rank, (msg.version, msg.layer, msg.tokens_per_expert)))
                action, batches[rank] = script(rank, batches[rank]), batches[rank] + 1
                if action == "drop":
                    return
                if action == "slow":
                    await anyio.sleep(0.3)
                if action == "reject":
                    await conn.send(ExpertResult(msg.call_id, error="scripted rejection"))
                else:
                    await conn.send(ExpertResult(msg.call_id, to_wire(from_wire(msg.x) * 2)))
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return  # the client went away
        finally:
            await conn.aclose()

    async def start(rank: int, task_status: anyio.abc.TaskStatus) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        task_status.started(listener.extra(SocketAttribute.local_port))
        async def on_connect(stream: SocketStream) -> None:
            conn = await accept(stream, NO_SECRET, "a test", logging.getLogger(__name__))
            assert conn is not None
            await handle(rank, conn)

        await listener.serve(on_connect)

    with start_blocking_portal() as portal:
        ports = [portal.start_task(start, rank)[1] for rank in range(2)]
        yield [("127.0.0.1", port) for port in ports]
        portal.call(portal.stop, True)  # cancel_remaining: the listeners


def step(experts: RpcExperts) -> torch.Tensor:
    """One MoE layer: 4 tokens, each to one expert of each rank (weights 1)."""
    x = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
    ids = torch.tensor([[0, 1], [2, 3], [0, 3], [2, 1]])
    return experts(0, x, ids, torch.ones(4, 2))


def test_a_rejected_batch_costs_its_step_and_never_the_other_rank() -> None:
    """Rank 0 rejects its first batch while rank 1 is still answering (slowly): that step
    fails naming rank 0; the next steps are whole (before, rank 1's late answer stayed
    unread and every later step was "answered out of turn")."""
    script = {(0, 0): "reject", (1, 0): "slow"}
    with expert_servers(lambda rank, n: script.get((rank, n), "ok")) as addresses:
        experts = RpcExperts(PLACEMENT, addresses, call_timeout=5)
        try:
            with pytest.raises(ExpertRankError, match=r"expert rank 0 .* rejected layer 0"):
                step(experts)
            x = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
            for _ in range(3):
                assert torch.equal(step(experts), x * 4)  # two experts, each 2x, weight 1
            assert experts.ready()
        finally:
            experts.close()


def test_a_rebalance_is_prepared_off_the_step_and_switched_between_steps() -> None:
    """`prepare` has every rank load the new placement (the steps meanwhile go on by the
    old one); `switch` tells each connection, and the next steps' batches are laid out
    by the new shares, under the new version: the same outputs. A rank that cannot load
    fails the rebalance, naming it, and the old placement routes on."""
    seen: list[tuple[int, object]] = []
    moved = Placement(2, 4, {0: ((1,), (0, 1), (0,), (0,))})  # rank 0: 1, 2, 3; rank 1: 0, 1
    x = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
    with expert_servers(lambda rank, n: "ok", seen) as addresses:
        experts = RpcExperts(PLACEMENT, addresses, call_timeout=5)
        try:
            assert experts.prepare(1, moved.to_json()) == 0.1
            assert experts.placement_version == 0
            assert torch.equal(step(experts), x * 4)
            experts.switch(1)
            assert experts.placement_version == 1 and experts.placement_json == moved.to_json()
            assert torch.equal(step(experts), x * 4)
            with pytest.raises(ValueError, match="was not prepared"):
                experts.switch(2)
        finally:
            experts.close()
    assert [(r, m) for r, m in seen if isinstance(m, UsePlacement)] == [
        (0, UsePlacement(0)), (1, UsePlacement(0)), (0, UsePlacement(1)), (1, UsePlacement(1))]
    batches = [(r, m) for r, m in seen if not isinstance(m, UsePlacement)]
    assert sorted(batches) == [(0, (0, 0, [2, 2])), (0, (1, 0, [1, 2, 2])),
                               (1, (0, 0, [2, 2])), (1, (1, 0, [2, 1]))]
    with expert_servers(lambda rank, n: "refuse" if n < 0 else "ok") as addresses:
        experts = RpcExperts(PLACEMENT, addresses, call_timeout=5)
        try:
            with pytest.raises(ExpertRankError, match=r"expert rank 1 .* could not load "
                                                      r"placement version 1: no room"):
                experts.prepare(1, moved.to_json())
            with pytest.raises(ValueError, match="was not prepared"):
                experts.switch(1)
            assert torch.equal(step(experts), x * 4) and experts.placement_version == 0
        finally:
            experts.close()


def test_a_rank_that_drops_its_connection_is_reconnected_and_the_call_sent_again() -> None:
    """Rank 1 (whose experts have no replica) hangs up on its first batch: the step is
    held, the rank connected again (it listens still), and the layer call sent again;
    the step's outputs are whole."""
    script = {(1, 0): "drop"}
    with expert_servers(lambda rank, n: script.get((rank, n), "ok")) as addresses:
        experts = RpcExperts(PLACEMENT, addresses, call_timeout=5)
        try:
            x = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
            assert torch.equal(step(experts), x * 4)
            assert torch.equal(step(experts), x * 4)
            assert experts.ready()
        finally:
            experts.close()


def test_a_rank_that_stays_away_fails_the_held_step_after_the_call_timeout() -> None:
    """Rank 1 hangs up on every batch: the step is held for the call timeout at most,
    then fails naming the rank."""
    with expert_servers(lambda rank, n: "drop" if rank == 1 else "ok") as addresses:
        experts = RpcExperts(PLACEMENT, addresses, call_timeout=1)
        try:
            start = time.monotonic()
            with pytest.raises(ExpertRankError, match=r"expert rank 1 .* failed on layer 0"):
                step(experts)
            assert time.monotonic() - start < 5
        finally:
            experts.close()


def test_a_batch_over_the_frame_limit_goes_in_several_frames(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The expert would drop the connection on a frame over the limit: a rank's rows go
    in several calls instead, cut between rows (and between experts' rows), and come back
    in order."""
    from ep_dispatch import rpc

    calls = [0, 0]

    def counting(rank: int, n: int) -> str:
        calls[rank] += 1
        return "ok"

    with expert_servers(counting) as addresses:
        experts = RpcExperts(PLACEMENT, addresses, call_timeout=5)
        try:
            x = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
            assert torch.equal(step(experts), x * 4) and calls == [1, 1]
            monkeypatch.setattr(rpc, "MAX_FRAME_BYTES", rpc.FRAME_MARGIN + 32)  # 1 row of 8
            assert torch.equal(step(experts), x * 4)  # 4 rows per rank: 4 calls each
            assert calls == [5, 5] and experts.ready()
        finally:
            experts.close()


@given(st.lists(st.integers(0, 9), min_size=1, max_size=6), st.integers(1, 12))
def test_chunks_keep_every_row_in_order(counts: list[int], rows: int) -> None:
    from ep_dispatch.rpc import chunk_counts

    chunks = chunk_counts(counts, rows)
    assert [sum(c) for c in chunks[:-1]] == [rows] * (len(chunks) - 1)  # full but the last
    assert all(0 < sum(c) <= rows for c in chunks)
    assert [sum(c[e] for c in chunks) for e in range(len(counts))] == counts
    # rows stay grouped by expert: flattening the chunks gives the original order
    flat = [e for c in chunks for e, n in enumerate(c) for _ in range(n)]
    assert flat == [e for e, n in enumerate(counts) for _ in range(n)]
