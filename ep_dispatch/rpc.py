"""`rpc` backend: M:N over TCP with msgspec frames; expert services are the servers.

A layer call is made on the engine's step thread itself, over blocking sockets
(`common.rpc.SocketFrames`): the rows go to every expert rank that holds some of them,
then each rank's answer is read, all within the call timeout. No thread and no event
loop is crossed, so the step's time is the model's and the experts', and a caller that
splits a step into micro-batches can overlap their exchanges. The connections, and the
failover around a lost rank (routed to replicas, probed until back), are `rpc_pool`'s.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import deque

import torch

from common import tracing
from common.auth import NO_SECRET, ClusterSecret
from common.compute import waiting
from common.messages import ExpertBatch, ExpertResult
from common.rpc import LINK_TIMEOUT_S, MAX_FRAME_BYTES
from ep_dispatch.base import PointToPoint
from ep_dispatch.layout import ReplicaTurns, combine, compute_layout
from ep_dispatch.metrics import phase
from ep_dispatch.placement import Placement
from ep_dispatch.rpc_pool import ExpertPool, ExpertRankError
from ep_dispatch.wire import activation_rows, from_wire, to_wire

FRAME_MARGIN = 4096  # a frame's bytes besides its rows (message fields, msgpack)
log = logging.getLogger("switchyard.rpc_experts")


class RpcExperts(PointToPoint):
    overlaps = True  # `start` returns while the expert ranks compute

    def __init__(self, placement: Placement, addresses: list[tuple[str, int]],
                 call_timeout: float = 30.0, connect_timeout: float = 30.0,
                 quantization: str | None = None, secret: ClusterSecret = NO_SECRET,
                 link_timeout: float = LINK_TIMEOUT_S) -> None:
        self.pool = ExpertPool(placement, addresses, call_timeout, connect_timeout,
                               quantization, secret, link_timeout)
        self.quantization = quantization
        self.call_timeout = call_timeout
        self.dispatch_bytes = 0  # activation bytes sent to expert ranks, for accounting
        self._ids = itertools.count()
        self._turns = ReplicaTurns()  # rotates each layer's first replica
        self._pending: dict[int, set[int]] = {}  # per rank, call ids sent and not yet read
        self._early: dict[int, dict[int, ExpertResult]] = {}  # per rank, answers read early
        self._round_trips: deque[float] = deque(maxlen=64)  # seconds, one-batch calls'

    def round_trip_s(self) -> float | None:
        """The median of the recent one-batch layer calls' times less the expert ranks'
        (`ExpertResult.held_s`): the wire there and back, and the rows' serialisation."""
        return statistics.median(self._round_trips) if self._round_trips else None

    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        with phase("dispatch", "rpc", layer, x.shape[0]):
            exchange = self.start(layer, x, topk_ids, topk_weights)
            ys = exchange.receive()
            # read as soon as sent (a pipelined exchange's answers may wait to be read)
            self._round_trips.append(time.perf_counter() - exchange.sent_at - exchange.held_s)
        with phase("combine", "rpc", layer, x.shape[0]):
            return exchange.combine(ys)

    def start(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> RpcExchange:
        """`__call__`'s first half: the rows sent to the expert ranks now, their answers
        read by the returned exchange's `finish`, so that a caller can compute another
        micro-batch meanwhile (the ping-pong pipeline). Exchanges finish in the order
        they started: each rank answers its connection's calls in turn."""
        rows = activation_rows(x, self.quantization)  # [T, H], or MXFP4 rows
        if self.pool.empty_call is None:
            self.pool.empty_call = to_wire(rows[:0])
        trace = tracing.inject() if tracing.detailed() else {}
        exchange = RpcExchange(self, layer, x, rows, topk_ids, topk_weights, trace,
                            self._turns(layer))
        exchange.send()
        return exchange

    def _send(self, rank: int, layer: int, x: torch.Tensor, counts: list[int],
              trace: dict[str, str]) -> tuple[list[int], float]:
        """Rank `rank`'s rows x [n, width] in as many calls as the frame limit needs
        (one either way must stay under it, or the expert would drop it)."""
        deadline = time.monotonic() + self.call_timeout
        margin = FRAME_MARGIN + 9 * len(counts)  # the message; each count at most 9 bytes
        rows = max(1, (MAX_FRAME_BYTES - margin) // _row_bytes(x))
        chunks = [counts] if x.shape[0] <= rows else chunk_counts(counts, rows)
        version = self.pool.version
        batches = [ExpertBatch(next(self._ids), layer, chunk, to_wire(part), trace, version)
                   for part, chunk in zip(x.split([sum(c) for c in chunks]), chunks,
                                          strict=True)]  # (a failure here is no rank's)
        conn = self.pool.conn(rank)
        try:
            for batch in batches:
                conn.send(batch, deadline)
                self._pending.setdefault(rank, set()).add(batch.call_id)
                self.dispatch_bytes += len(batch.x.data)
        except BaseException as exc:
            self._lost(rank, layer, exc)
        return [b.call_id for b in batches], deadline

    def _receive(self, rank: int, layer: int, call_ids: list[int], deadline: float
                 ) -> tuple[torch.Tensor, float]:
        """The outputs [n, H] of `rank`'s calls, in order, and the longest the rank held
        one (`ExpertResult.held_s`). A rank answers its connection's calls in turn, and
        exchanges in flight share that connection (a micro-batch's exchange sent again to
        replicas queues behind another's calls): answers to another exchange's calls are
        kept for it (`_early`)."""
        conn = self.pool.conns[rank]
        if conn is None:  # dropped since the calls were sent (another exchange failed)
            raise ExpertRankError(f"{self.pool.name(rank)} was lost before layer {layer} "
                                  "answered", frozenset({rank}))
        pending, early = self._pending.setdefault(rank, set()), self._early.setdefault(rank, {})
        results = []
        try:
            for call_id in call_ids:
                result = early.pop(call_id, None)
                while result is None:
                    with waiting():  # the attention service's bubble, not its work
                        got = conn.receive(deadline)
                    if not isinstance(got, ExpertResult) or got.call_id not in pending:
                        raise ExpertRankError(f"{self.pool.name(rank)} answered out of turn")
                    pending.discard(got.call_id)
                    if got.call_id == call_id:
                        result = got
                    else:
                        early[got.call_id] = got
                results.append(result)
        except BaseException as exc:
            self._lost(rank, layer, exc)
        ys = []
        for r in results:
            if r.error is not None or r.y is None:
                raise ExpertRankError(f"{self.pool.name(rank)} rejected layer {layer}: "
                                      f"{r.error}")
            ys.append(from_wire(r.y))
        return ys[0] if len(ys) == 1 else torch.cat(ys), max(r.held_s for r in results)

    def _lost(self, rank: int, layer: int, exc: BaseException) -> None:
        """Timed out, dropped, out of turn, garbage, or interrupted: the connection may
        hold a late answer now, so it is never used again; the rank is lost (an
        interruption is raised as it is)."""
        self.pool.drop(rank)
        self._pending.pop(rank, None)  # its calls in flight will never be answered
        self._early.pop(rank, None)
        if isinstance(exc, Exception):
            raise ExpertRankError(f"{self.pool.name(rank)} failed on layer {layer}: {exc!r}",
                                  frozenset({rank})) from exc
        raise exc

    def prepare(self, version: int, placement_json: str) -> float:
        """A rebalance's first half, off the step thread: every expert rank loads its
        share of the placement (JSON) as `version`; the slowest rank's load seconds.
        Raises `PlacementError` (not a placement of this model) or `ExpertRankError`."""
        current = self.pool.placement
        placement = Placement.from_json(placement_json, sorted(current.replicas),
                                        current.num_experts, f"placement version {version}")
        return max(r.load_s for r in self.pool.prepare(version, placement))

    def switch(self, version: int) -> Placement:
        """Its second half, on the step thread between two steps: the calls from now on
        are laid out by prepared placement `version` (returned)."""
        self.pool.switch(version)
        return self.pool.placement

    @property
    def placement_version(self) -> int:
        return self.pool.version

    @property
    def placement_json(self) -> str:
        return self.pool.placement.to_json()

    def ready(self) -> bool:
        return self.pool.ready()

    def describe(self) -> list[str]:
        return self.pool.describe()

    def close(self) -> None:
        self.pool.close()


class RpcExchange:
    """One layer call of `RpcExperts`: its layout, the calls sent to each rank, and then
    the answers read back and combined. A lost rank's rows are sent again to replicas of
    its experts (while they have some), and waited for at once."""

    def __init__(self, client: RpcExperts, layer: int, x: torch.Tensor, rows: torch.Tensor,
                 topk_ids: torch.Tensor, topk_weights: torch.Tensor, trace: dict[str, str],
                 turn: int) -> None:
        self.client, self.layer, self.x, self.rows = client, layer, x, rows
        self.topk_ids, self.topk_weights = topk_ids, topk_weights
        self.trace, self.turn = trace, turn
        self.sent: dict[int, tuple[list[int], float]] = {}  # rank -> its call ids, deadline
        self.errors: list[ExpertRankError] = []
        self.hold_until: float | None = None  # waiting for lost ranks to come back, till

    def send(self) -> None:
        """Lay the rows out over the ranks reachable now and send each rank its own."""
        self.layout = compute_layout(self.topk_ids, self.topk_weights,
                                     self.client.pool.routing(), self.layer, self.turn)
        # per rank [n_r, width], copied to the host once for the wire
        self.parts = self.rows[self.layout.src_token].cpu().split(self.layout.rank_counts)
        self.sent, self.errors = {}, []
        self.sent_at, self.held_s = time.perf_counter(), 0.0
        for rank, part in enumerate(self.parts):
            if part.shape[0]:
                try:
                    self.sent[rank] = self.client._send(rank, self.layer, part,
                                                        self.layout.expert_counts[rank],
                                                        self.trace)
                except ExpertRankError as exc:
                    self.errors.append(exc)

    def receive(self) -> list[torch.Tensor]:
        """Every rank's outputs [n_r, H], once each answered (sent again around lost
        ranks while their experts have replicas, else to those ranks once they are back
        within the call timeout). A rank that fails is named; the others' calls finish,
        keeping their connections."""
        while True:
            ys: list[torch.Tensor] = list(self.parts)  # empty parts stay as they are
            for rank, (call_ids, deadline) in self.sent.items():
                try:
                    ys[rank], held = self.client._receive(rank, self.layer, call_ids,
                                                          deadline)
                    self.held_s = max(self.held_s, held)
                except ExpertRankError as exc:
                    self.errors.append(exc)
            if not self.errors:
                return ys
            first = min(self.errors, key=str)  # the lowest rank's message
            exc = ExpertRankError(str(first), frozenset().union(*(e.lost for e in self.errors)))
            # ranks another exchange in flight found lost meanwhile are routed around
            # already: this one's next layout leaves them out
            stale = bool(exc.lost) and exc.lost <= self.client.pool.lost
            if not (stale or self.client.pool.route_around(exc) or self._held(exc)):
                raise exc
            self.send()

    def _held(self, exc: ExpertRankError) -> bool:
        """Whether the ranks `exc` lost, which no replica can stand in for, came back
        within the call timeout of the first loss (the step held meanwhile): then this
        layer call is sent again, and the step goes on as if nothing had happened."""
        if not exc.lost:
            return False  # a rank that answered with an error: not to be waited for
        if self.hold_until is None:
            self.hold_until = time.monotonic() + self.client.call_timeout
            log.warning("holding the step for layer %d: %s; waiting up to %.0f s for it "
                        "to come back", self.layer, exc, self.client.call_timeout)
        return self.client.pool.wait_back(exc.lost, self.hold_until)

    def combine(self, ys: list[torch.Tensor]) -> torch.Tensor:
        """The MoE output [T, H]: the answers weighted into token order."""
        x = self.x
        ys = [y.to(x.device) if y.shape[0] else x[:0] for y in ys]  # [n_r, H] each
        return combine(torch.cat(ys).to(x.dtype) if ys else x[:0], self.layout)

    def finish(self) -> torch.Tensor:
        """`receive`, then `combine`, each timed as `__call__` times them."""
        tokens = self.x.shape[0]
        with phase("dispatch", "rpc", self.layer, tokens):
            ys = self.receive()
        with phase("combine", "rpc", self.layer, tokens):
            return self.combine(ys)


def _row_bytes(x: torch.Tensor) -> int:
    """The larger of a row's bytes going out (x [n, width]) and coming back: an output
    row is H values of at most 4 bytes; MXFP4 rows are 17/32 bytes per value."""
    hidden = x.shape[1] if x.is_floating_point() else x.shape[1] * 32 // 17
    return max(x.shape[1] * x.element_size(), hidden * 4, 1)


def chunk_counts(counts: list[int], rows: int) -> list[list[int]]:
    """Rows grouped by expert (`counts` per expert, in order) cut into consecutive chunks
    of at most `rows` rows: each chunk's count per expert."""
    chunks: list[list[int]] = []
    current, room = [0] * len(counts), rows
    for expert, count in enumerate(counts):
        while count:
            take = min(count, room)
            current[expert] += take
            count, room = count - take, room - take
            if room == 0:
                chunks.append(current)
                current, room = [0] * len(counts), rows
    if room < rows:
        chunks.append(current)
    return chunks
