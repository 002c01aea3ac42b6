"""The `rpc` backend: M:N over TCP with msgspec frames. The expert services are the servers.

A layer call is made on the engine's step thread itself, over blocking sockets from
`common.rpc.SocketFrames`. The rows go to every expert rank that holds some of them, then
each rank's answer is read, all within the call timeout. No thread and no event loop is
crossed, so the step's time is the model's and the experts'. A caller that splits a step
into micro-batches can overlap their exchanges. `rpc_pool` owns the connections, and the
failover around a lost rank: routing to replicas, and probing until the rank is back.

Every expert rank holding rows is sent its rows, then every answer is read, so the ranks
compute at once. Rows that would make a frame over the 256 MiB limit go in several calls,
cut between rows. A call that fails in any way closes its connection, so that a late answer
is never read as the next call's. The other ranks' calls of that layer call finish, and
keep their connections. The failed rank is connected again, with its handshake, at its
next call or by the next readiness check (`/health`). So health recovers without traffic.

If some expert of a lost rank has no replica, the attention service holds the step. It
sends the layer call again once the rank is back (`ExpertPool.wait_back`), within
`--expert-timeout` of the loss. Past that, the step's requests fail with a 503 naming the
rank.

With `--enable-eplb` the placement changes while serving, as in vLLM's and SGLang's EPLB.
Placements have numbered versions, and the one the services start with is 0. The gateway
decides when to move and to what, in `gateway.routing.rebalancer`. A placement equal to
the current one is not moved to. `POST /eplb/rebalance` also takes an explicit placement.
A rebalance shows up as a span (`eplb rebalance`), as `switchyard:eplb_rebalances_total`,
`switchyard:eplb_rebalance_seconds` and `switchyard:eplb_placement_version` on the
gateway's `/metrics`, as a record on `GET /eplb`, and as a line on the dashboard. Here it
has two halves:

- Loading, in `prepare`. The gateway sends a `Rebalance` to each group, and the group
  sends a `PlacementUpdate` to each expert rank. The group's client asks every expert rank
  to load its share of version v, on connections of its own and off the step thread. The
  rank loads it while it answers layer calls, in `ExpertServer.prepare`. No step waits for
  it. Several groups asking for the same version load it once.
- Switching, in `switch`. Once every rank has version v, the attention service switches
  between two steps, on the step thread. The layouts of the next step come from v's
  routing tables, every `ExpertBatch` names its version, and each connection tells its
  rank `UsePlacement(v)`. Each group switches all its layers at once. Groups switch
  independently, since every rank holds both versions meanwhile.

So a layer's move is not spread over several steps. The load is spread, by layer and in
the background, and the switch is one step boundary. A rank that cannot load fails the
rebalance, and its record names the rank. It may be unreachable, get a bad placement, or
run out of memory. The old version then routes on. A rank restarted after a rebalance
comes back with version 0. The probe that finds it loads the current version into it,
with a `PlacementUpdate` on the probe's connection, before it is routed to again; see
`rpc_pool`.
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

FRAME_MARGIN = 4096  # a frame's bytes besides its rows: message fields, msgpack
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
        self._round_trips: deque[float] = deque(maxlen=64)  # seconds, of one-batch calls

    def round_trip_s(self) -> float | None:
        """The median round trip of the recent one-batch layer calls.

        It is a call's time less the expert ranks' time, `ExpertResult.held_s`. That leaves
        the wire there and back, and the rows' serialisation.
        """
        return statistics.median(self._round_trips) if self._round_trips else None

    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        with phase("dispatch", "rpc", layer, x.shape[0]):
            exchange = self.start(layer, x, topk_ids, topk_weights)
            ys = exchange.receive()
            # Measured here, where answers are read as soon as sent. A pipelined exchange's
            # answers may wait to be read.
            self._round_trips.append(time.perf_counter() - exchange.sent_at - exchange.held_s)
        with phase("combine", "rpc", layer, x.shape[0]):
            return exchange.combine(ys)

    def start(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> RpcExchange:
        """`__call__`'s first half: send the rows to the expert ranks now.

        The returned exchange's `finish` reads the answers, so a caller can compute another
        micro-batch meanwhile. This is the ping-pong pipeline. Exchanges finish in the
        order they started, because each rank answers its connection's calls in turn.
        """
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
        """Send rank `rank`'s rows x [n, width] in as many calls as the frame limit needs.

        Every call must stay under the limit, or the expert would drop it.
        """
        deadline = time.monotonic() + self.call_timeout
        margin = FRAME_MARGIN + 9 * len(counts)  # the message, with each count at most 9 bytes
        rows = max(1, (MAX_FRAME_BYTES - margin) // _row_bytes(x))
        chunks = [counts] if x.shape[0] <= rows else chunk_counts(counts, rows)
        version = self.pool.version
        batches = [ExpertBatch(next(self._ids), layer, chunk, to_wire(part), trace, version)
                   for part, chunk in zip(x.split([sum(c) for c in chunks]), chunks,
                                          strict=True)]  # a failure here is no rank's fault
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
        """The outputs [n, H] of `rank`'s calls, in order, and the longest the rank held one.

        The hold time is `ExpertResult.held_s`. A rank answers its connection's calls in
        turn, and exchanges in flight share that connection. For example, a micro-batch's
        exchange sent again to replicas queues behind another exchange's calls. Answers to
        another exchange's calls are kept for it in `_early`.
        """
        conn = self.pool.conns[rank]
        # Dropped since the calls were sent, because another exchange failed.
        if conn is None:
            raise ExpertRankError(f"{self.pool.name(rank)} was lost before layer {layer} "
                                  "answered", frozenset({rank}))
        pending, early = self._pending.setdefault(rank, set()), self._early.setdefault(rank, {})
        results = []
        try:
            for call_id in call_ids:
                result = early.pop(call_id, None)
                while result is None:
                    with waiting():  # the attention service's idle bubble, not its work
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
        """Mark the rank lost: its call timed out, was dropped, was interrupted, or got an
        answer out of turn or garbage.

        The connection may hold a late answer now, so it is never used again. An
        interruption is raised as it is.
        """
        self.pool.drop(rank)
        self._pending.pop(rank, None)  # its calls in flight will never be answered
        self._early.pop(rank, None)
        if isinstance(exc, Exception):
            raise ExpertRankError(f"{self.pool.name(rank)} failed on layer {layer}: {exc!r}",
                                  frozenset({rank})) from exc
        raise exc

    def prepare(self, version: int, placement_json: str) -> float:
        """A rebalance's first half, off the step thread.

        Every expert rank loads its share of the placement's JSON as `version`. Returns
        the slowest rank's load seconds. Raises `PlacementError` if this is not a placement
        of this model, or `ExpertRankError`.
        """
        current = self.pool.placement
        placement = Placement.from_json(placement_json, sorted(current.replicas),
                                        current.num_experts, f"placement version {version}")
        return max(r.load_s for r in self.pool.prepare(version, placement))

    def switch(self, version: int) -> Placement:
        """A rebalance's second half, on the step thread between two steps.

        From now on the calls are laid out by the prepared placement `version`, which is
        returned.
        """
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
    """One layer call of `RpcExperts`.

    It holds the call's layout and the calls sent to each rank, then reads the answers
    back and combines them. A lost rank's rows are sent again to replicas of its experts,
    while they have some, and waited for at once.
    """

    def __init__(self, client: RpcExperts, layer: int, x: torch.Tensor, rows: torch.Tensor,
                 topk_ids: torch.Tensor, topk_weights: torch.Tensor, trace: dict[str, str],
                 turn: int) -> None:
        self.client, self.layer, self.x, self.rows = client, layer, x, rows
        self.topk_ids, self.topk_weights = topk_ids, topk_weights
        self.trace, self.turn = trace, turn
        self.sent: dict[int, tuple[list[int], float]] = {}  # rank -> (its call ids, deadline)
        self.errors: list[ExpertRankError] = []
        self.hold_until: float | None = None  # deadline for lost ranks to come back

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
        """Every rank's outputs [n_r, H], once each rank answered.

        Calls are sent again around lost ranks while their experts have replicas.
        Otherwise they go to those ranks once they are back within the call timeout. A
        rank that fails is named. The other ranks' calls finish, and keep their
        connections.
        """
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
            # Ranks that another exchange in flight found lost meanwhile are routed around
            # already. This exchange's next layout leaves them out.
            stale = bool(exc.lost) and exc.lost <= self.client.pool.lost
            if not (stale or self.client.pool.route_around(exc) or self._held(exc)):
                raise exc
            self.send()

    def _held(self, exc: ExpertRankError) -> bool:
        """Whether the ranks `exc` lost came back within the call timeout of the first loss.

        These are ranks that no replica can stand in for, and the step is held meanwhile.
        If they came back, this layer call is sent again, and the step goes on as if
        nothing had happened.
        """
        if not exc.lost:
            return False  # a rank that answered with an error is not waited for
        if self.hold_until is None:
            self.hold_until = time.monotonic() + self.client.call_timeout
            log.warning("holding the step for layer %d: %s; waiting up to %.0f s for it "
                        "to come back", self.layer, exc, self.client.call_timeout)
        return self.client.pool.wait_back(exc.lost, self.hold_until)

    def combine(self, ys: list[torch.Tensor]) -> torch.Tensor:
        """The MoE output [T, H]: the answers, weighted, in token order."""
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
    """The larger of a row's bytes going out, from x [n, width], and coming back.

    An output row is H values of at most 4 bytes. MXFP4 rows take 17/32 bytes per value.
    """
    hidden = x.shape[1] if x.is_floating_point() else x.shape[1] * 32 // 17
    return max(x.shape[1] * x.element_size(), hidden * 4, 1)


def chunk_counts(counts: list[int], rows: int) -> list[list[int]]:
    """Cut rows grouped by expert into consecutive chunks of at most `rows` rows.

    `counts` holds the rows per expert, in order. Returns each chunk's count per expert.
    """
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
