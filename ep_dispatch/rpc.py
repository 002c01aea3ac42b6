"""`rpc` backend: asyncio M:N over TCP with msgspec frames; expert services are the servers.

The engine calls from its worker thread; the exchange runs on this client's own event
loop (an anyio blocking portal), one concurrent `ExpertBatch` per expert rank holding rows
of the layer, each bounded by a timeout.

An expert rank that is lost (its connection dropped, refused, timed out, or answering
what is no answer) is routed around while the placement has a replica of each of its
experts elsewhere: the layer call is made again without it, and the rank is probed in
the background until it answers its handshake and an empty layer call again (a rank whose
computation is stuck still answers handshakes). Without replicas the call fails, as the
step it belongs to.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time

import anyio
import torch
from anyio.from_thread import start_blocking_portal

from common import tracing
from common.messages import ExpertBatch, ExpertInfo, ExpertResult, InfoRequest
from common.rpc import MAX_FRAME_BYTES, FrameStream, connect
from ep_dispatch.base import PointToPoint
from ep_dispatch.layout import ReplicaTurns, combine, compute_layout
from ep_dispatch.metrics import phase
from ep_dispatch.placement import Placement
from ep_dispatch.wire import activation_rows, from_wire, to_wire

log = logging.getLogger("switchyard.rpc_experts")
PROBE_EVERY_S = 1.0  # how often a lost rank that is routed around is tried again


class ExpertRankError(RuntimeError):
    """An expert rank that cannot be reached or answered wrongly; names the rank.
    `lost`: the ranks whose connection is gone (their calls may go to replicas)."""

    def __init__(self, message: str, lost: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.lost = lost


class RpcExperts(PointToPoint):
    def __init__(self, placement: Placement, addresses: list[tuple[str, int]],
                 call_timeout: float = 30.0, connect_timeout: float = 30.0,
                 quantization: str | None = None) -> None:
        if len(addresses) != placement.num_ranks:
            raise ValueError(f"{len(addresses)} expert addresses for a placement of "
                             f"{placement.num_ranks} ranks")
        self.placement = placement
        self.addresses = addresses
        self.call_timeout = call_timeout
        self.quantization = quantization
        self.dispatch_bytes = 0  # activation bytes sent to expert ranks, for accounting
        self._ids = itertools.count()
        self._turns = ReplicaTurns()  # rotates each layer's first replica
        self._portal_cm = start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._conns: list[FrameStream | None] = [None] * len(addresses)
        # Lost ranks, routed around while replicas allow, and those being probed; shared
        # by the engine's thread and the portal's.
        self._lost: set[int] = set()
        self._probing: set[int] = set()
        self._lock = threading.Lock()
        self._routes: dict[frozenset[int], Placement] = {}  # by the lost ranks
        self._probes: dict[int, anyio.CancelScope] = {}  # the loop's own: no lock
        self._closing = False  # then no probe starts (under `_lock`)
        self._reconnecting = False  # a reconnection for readiness is running (`_lock`)
        self._connecting: dict[int, anyio.Lock] = {}  # per rank, the loop's own: no lock
        self._no_rows: torch.Tensor | None = None  # [0, width] rows on the wire: for probes
        self.infos: list[ExpertInfo] = []
        try:
            self.infos = self._portal.call(self._connect_all, connect_timeout)
        except BaseException:
            self.close()
            raise

    def _name(self, rank: int) -> str:
        host, port = self.addresses[rank]
        return f"expert rank {rank} at {host}:{port}"

    async def _connect_all(self, timeout: float) -> list[ExpertInfo]:
        infos: list[ExpertInfo | None] = [None] * len(self.addresses)
        errors: list[ExpertRankError] = []

        async def one(rank: int) -> None:
            try:
                infos[rank] = await self._handshake(rank, timeout)
            except ExpertRankError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for rank in range(len(self.addresses)):
                tg.start_soon(one, rank)
        if errors:
            raise min(errors, key=str)  # deterministic: the lowest rank's message
        return [i for i in infos if i is not None]

    async def _handshake(self, rank: int, timeout: float, retry: bool = True) -> ExpertInfo:
        """Connect to `rank` (`retry`: until it listens) and check that it holds the
        placement's share; the connection is kept only if it does."""
        try:
            conn = await connect(*self.addresses[rank], timeout=timeout, retry=retry)
        except TimeoutError:
            raise ExpertRankError(f"cannot reach {self._name(rank)} within "
                                  f"{timeout:g}s") from None
        try:
            with anyio.fail_after(timeout):
                await conn.send(InfoRequest())
                info = await conn.receive()
        except BaseException:
            await _close(conn)
            raise
        want = self.placement.local_experts(rank)
        problem = None
        if not isinstance(info, ExpertInfo) or info.rank != rank or info.experts != want:
            problem = f"holds a different share than the placement expects: {info}"
        elif info.quantization != self.quantization:
            problem = (f"serves quantization {info.quantization}, this attention service "
                       f"{self.quantization}: start both with the same --quantization")
        if problem:
            await _close(conn)
            raise ExpertRankError(f"{self._name(rank)} {problem}")
        self._conns[rank] = conn
        return info

    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        with phase("dispatch", "rpc", layer, x.shape[0]):
            rows = activation_rows(x, self.quantization)  # [T, H], or MXFP4 rows
            if self._no_rows is None:
                self._no_rows = rows[:0].cpu()
            trace = tracing.inject() if tracing.detailed() else {}
            turn = self._turns(layer)
            while True:  # again without each lost rank, while its experts have replicas
                layout = compute_layout(topk_ids, topk_weights, self._routing(), layer, turn)
                # per rank [n_r, width], copied to the host once for the wire
                parts = rows[layout.src_token].cpu().split(layout.rank_counts)
                try:
                    ys = self._portal.call(self._exchange, layer, parts,
                                           layout.expert_counts, trace)
                    break
                except ExpertRankError as exc:
                    if not self._route_around(exc):
                        raise
        with phase("combine", "rpc", layer, x.shape[0]):
            ys = [y.to(x.device) if y.shape[0] else x[:0] for y in ys]  # [n_r, H] each
            return combine(torch.cat(ys).to(x.dtype) if ys else x[:0], layout)

    def _routing(self) -> Placement:
        """The placement without the lost ranks, each of which is being probed."""
        with self._lock:  # (never held across a portal call: the loop takes it too)
            if not self._lost:
                return self.placement
            new = set() if self._closing else self._lost - self._probing
            self._probing |= new
            lost = frozenset(self._lost)
        for rank in new:
            self._portal.start_task_soon(self._probe, rank)
        if lost not in self._routes:  # (a placement builds its lookup tables once)
            routing = self.placement.excluding(lost)
            assert routing is not None  # `_route_around` adds ranks only while this holds
            self._routes[lost] = routing
        return self._routes[lost]

    def _route_around(self, exc: ExpertRankError) -> bool:
        """Whether the ranks `exc` lost can be routed around (then they are); each retry
        of a layer call loses one rank more, or is not made."""
        with self._lock:
            lost = self._lost | exc.lost
            if lost == self._lost or self.placement.excluding(frozenset(lost)) is None:
                return False
            for rank in sorted(exc.lost - self._lost):
                log.warning("%s is lost (%s): its experts go to their replicas until it "
                            "answers again", self._name(rank), exc)
            self._lost = lost
        return True

    async def _probe(self, rank: int) -> None:
        """Try a lost rank (its handshake, then an empty layer call) until it answers,
        every `PROBE_EVERY_S` at most (whatever a try raises); then it is back in the
        routing. `close` cancels it."""
        with anyio.CancelScope() as scope:
            self._probes[rank] = scope
            try:
                await self._probe_until_back(rank)
            finally:
                del self._probes[rank]
                with self._lock:
                    self._probing.discard(rank)

    async def _probe_until_back(self, rank: int) -> None:
        reason = ""
        while True:
            started = time.monotonic()
            try:
                await self._connect(rank, retry=True)
                await self._serves_a_call(rank)
                break
            except Exception as exc:  # e.g. a share that differs: said once, tried again
                if str(exc) != reason:
                    reason = str(exc)
                    log.warning("%s is still lost: %s", self._name(rank), reason or repr(exc))
                await anyio.sleep(max(0.0, started + PROBE_EVERY_S - time.monotonic()))
        with self._lock:
            self._lost.discard(rank)
        log.warning("%s answers again: back in the routing", self._name(rank))

    async def _serves_a_call(self, rank: int) -> None:
        """An empty layer call to a rank just connected again, answered within the call
        timeout: it waits behind whatever that rank computes, as a real call would."""
        experts = self.placement.local_experts(rank)
        if self._no_rows is None or not experts:
            return  # no call was made yet: nothing to be stuck behind
        layer = min(experts)
        await self._call_once(rank, layer, self._no_rows, [0] * len(experts[layer]), {})

    async def _exchange(self, layer: int, parts: tuple[torch.Tensor, ...],
                        counts: list[list[int]], trace: dict[str, str]
                        ) -> list[torch.Tensor]:
        ys: list[torch.Tensor] = list(parts)  # empty parts stay as they are
        errors: list[ExpertRankError] = []

        async def one(rank: int) -> None:
            try:
                ys[rank] = await self._call(rank, layer, parts[rank], counts[rank], trace)
            except ExpertRankError as exc:  # the others' calls end on their own: cancelled,
                errors.append(exc)  # their connections would close, and be opened again

        async with anyio.create_task_group() as tg:
            for rank, part in enumerate(parts):
                if part.shape[0]:
                    tg.start_soon(one, rank)
        if errors:
            first = min(errors, key=str)  # the lowest rank's message
            raise ExpertRankError(str(first), frozenset().union(*(e.lost for e in errors)))
        return ys

    def ready(self) -> bool:
        """Whether every layer call can be served: every rank connected, or lost and
        routed around. A rank dropped otherwise is connected again at its next call, and
        in the background from here: a health check that keeps asking (while no traffic
        comes, because it answered "not ready") sees it back."""
        with self._lock:
            missing = [rank for rank, conn in enumerate(self._conns)
                       if conn is None and rank not in self._lost]
            start = bool(missing) and not self._reconnecting and not self._closing
            self._reconnecting |= start
        if start:
            self._portal.start_task_soon(self._reconnect, missing)
        return not missing

    async def _reconnect(self, ranks: list[int]) -> None:
        try:
            for rank in ranks:
                with contextlib.suppress(Exception):  # still down: the next check tries
                    await self._connect(rank, retry=False)
        finally:
            with self._lock:
                self._reconnecting = False

    async def _connect(self, rank: int, retry: bool) -> None:
        """Connect to `rank` again (its handshake) unless it is connected: one task at a
        time, though a layer call, a probe and a readiness check may all try."""
        async with self._connecting.setdefault(rank, anyio.Lock()):
            if self._conns[rank] is None:
                await self._handshake(rank, self.call_timeout, retry=retry)

    async def _call(self, rank: int, layer: int, x: torch.Tensor, counts: list[int],
                    trace: dict[str, str]) -> torch.Tensor:
        """Rank `rank`'s rows x [n, width] grouped by its local experts (`counts`) ->
        outputs [n, H]; in several calls when one frame either way would be over the
        frame limit (the expert would drop it)."""
        margin = FRAME_MARGIN + 9 * len(counts)  # the message; each count at most 9 bytes
        rows = max(1, (MAX_FRAME_BYTES - margin) // _row_bytes(x))
        if x.shape[0] <= rows:
            return await self._call_once(rank, layer, x, counts, trace)
        chunks = chunk_counts(counts, rows)
        parts = x.split([sum(c) for c in chunks])
        return torch.cat([await self._call_once(rank, layer, part, c, trace)
                          for part, c in zip(parts, chunks, strict=True)])

    async def _call_once(self, rank: int, layer: int, x: torch.Tensor, counts: list[int],
                         trace: dict[str, str]) -> torch.Tensor:
        if self._conns[rank] is None:  # dropped on an earlier call: used again once back
            try:  # once: a refused connection is a lost rank now, not after call_timeout
                await self._connect(rank, retry=False)
            except Exception as exc:  # refused, dropped, timed out, garbage: lost
                raise ExpertRankError(f"{self._name(rank)} is not connected: {exc!r}",
                                      frozenset({rank})) from exc
        conn = self._conns[rank]
        assert conn is not None
        call_id, payload = next(self._ids), to_wire(x)
        try:
            with anyio.fail_after(self.call_timeout):
                self.dispatch_bytes += len(payload.data)
                await conn.send(ExpertBatch(call_id, layer, counts, payload, trace))
                result = await conn.receive()
            if not isinstance(result, ExpertResult) or result.call_id != call_id:
                raise ExpertRankError(f"{self._name(rank)} answered out of turn")
        except BaseException as exc:
            # Timed out, dropped, out of turn, garbage, or cancelled because another rank
            # failed: the stream may hold a late answer now, so it is never used again.
            self._conns[rank] = None
            await _close(conn)
            if isinstance(exc, Exception):  # not a cancellation: this rank is lost
                raise ExpertRankError(f"{self._name(rank)} failed on layer {layer}: "
                                      f"{exc!r}", frozenset({rank})) from exc
            raise
        if result.error is not None or result.y is None:
            raise ExpertRankError(f"{self._name(rank)} rejected layer {layer}: {result.error}")
        return from_wire(result.y)

    def describe(self) -> list[str]:
        return [f"{self._name(i.rank)}: {sum(map(len, i.experts.values()))} experts over "
                f"{len(i.experts)} MoE layers, {i.weight_bytes / 1e6:.1f} MB"
                f"{' MXFP4' if i.quantization else ''}, "
                f"{'connected' if self._conns[i.rank] else 'disconnected'}"
                f"{' (lost: routed to replicas)' if i.rank in self._lost else ''}"
                for i in self.infos]

    def close(self) -> None:
        async def close_all() -> None:
            for scope in list(self._probes.values()):  # first: one could connect meanwhile
                scope.cancel()
            with anyio.move_on_after(5):
                while self._probes:  # each closes its half-open connection as it ends
                    await anyio.sleep(0.01)
            for conn in self._conns:
                if conn is not None:
                    await conn.aclose()

        if self._portal_cm is not None:
            with self._lock:  # a step still running may lose a rank now: no new probe
                self._closing = True
            self._portal.call(close_all)
            self._portal.call(self._portal.stop, True)  # whatever is left, cancelled
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None


FRAME_MARGIN = 4096  # a frame's bytes besides its rows (message fields, msgpack)


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


async def _close(conn: FrameStream) -> None:
    """Close `conn`, also from a task being cancelled."""
    with anyio.CancelScope(shield=True):
        await conn.aclose()
