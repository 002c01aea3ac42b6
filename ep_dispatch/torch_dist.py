"""`torch` backend: torch.distributed all-to-all between attention and expert ranks.

One process group spans G attention ranks (world ranks 0..G-1) and N expert ranks
(world ranks G..G+N-1). It uses gloo on the CPU, and the same calls with NCCL on a GPU.
Collectives need every rank, so the ranks move in lockstep. Each round starts with an
all-reduce (max) of the micro-batches each attention rank runs its step as, 0 for none. If
any rank has work, every attention rank runs a step and every expert rank serves each MoE
layer that many times, layer by layer. An attention rank with fewer micro-batches, or an
idle one with none, joins the extra exchanges of each layer with zero rows, right after its
own.

Over torch.distributed the attention side issues a layer's three collectives at once,
asynchronously (`start`), and waits on them in `finish`. So a ping-pong pipeline computes
one micro-batch while the expert ranks serve another's layer, with the collectives running
in the order they were issued on every rank.

Per MoE layer there are three collectives: the per-expert row counts (`all_to_all_single`,
fixed size), the rows themselves (`all_to_all_single` with the counts as splits), and the
expert outputs back along the reverse splits. Combine applies the router weights on the
attention side. Rows travel as `wire.RowFormat` says: the activations, or with w4a4 their
MXFP4 bytes. Every rank checks at start-up that all of them move the same rows.

The lockstep protocol (`TorchExperts`, `serve_experts`) is written once over a `Collective`
of two operations, a flag all-reduce and `all_to_all`, which `TorchCollective` and the
`nccl` backend's `CupyNccl` implement. What a row is (`RowFormat`) is compared across every rank
through the rendezvous store at start-up, as a mismatch would mis-size the all-to-alls and
hang. The world's ranks are the attention ranks first, then the expert ranks, each expert
joining as its `--world-rank`. A failure of any rank restarts the whole world
(`switchyard.supervisor`). An MTP pass is a round of its own, which calls the MTP layer
(`ModelConfig.served_moe_layers`). Expert ranks serve every layer of the placement each
round, in order, and a rank joins the layers it does not call with zero rows
(`TorchExperts._join_until`). So ranks that draft and ranks that do not stay in step. Tested
with gloo on the CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from common.compute import waiting
from ep_dispatch.base import ExpertFn
from ep_dispatch.layout import Layout, ReplicaTurns, combine, compute_layout
from ep_dispatch.metrics import phase
from ep_dispatch.placement import Placement
from ep_dispatch.wire import RowFormat

log = logging.getLogger(__name__)


class RendezvousError(RuntimeError):
    """Peers that did not join in time; the message names them."""


@dataclass(frozen=True)
class World:
    """Where this process sits among G attention and N expert ranks."""

    init_address: tuple[str, int]  # the TCP store, hosted by attention rank 0
    num_attention: int
    num_experts: int
    rank: int  # world rank

    @property
    def size(self) -> int:
        return self.num_attention + self.num_experts

    def describe(self, rank: int) -> str:
        if rank < self.num_attention:
            return f"attention rank {rank}"
        return f"expert rank {rank - self.num_attention}"


def rendezvous(world: World, timeout: float) -> dist.TCPStore:
    """Meet every rank at the TCP store hosted by attention rank 0, naming any peer still
    missing after `timeout` seconds. The store stays usable for exchanging more."""
    host, port = world.init_address
    try:
        store = dist.TCPStore(host, port, world.size, is_master=world.rank == 0,
                              timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as exc:
        raise RendezvousError(f"{world.describe(world.rank)} cannot reach the rendezvous at "
                              f"{host}:{port} (hosted by attention rank 0): {exc}") from exc
    store.set(f"joined/{world.rank}", "1")
    _wait_all(store, world, "joined", timeout, f"at {host}:{port}")
    return store


def _wait_all(store: dist.Store, world: World, prefix: str, timeout: float,
              where: str) -> list[str]:
    """Wait until every rank has set `prefix/<rank>`, and return their values. Raises a
    `RendezvousError` naming the ranks still missing after `timeout` seconds."""
    keys = [f"{prefix}/{r}" for r in range(world.size)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:
        missing = [world.describe(r) for r, k in enumerate(keys) if not store.check([k])]
        raise RendezvousError(f"waited {timeout:g}s {where} for "
                              f"{', '.join(missing)}") from None
    return [store.get(key).decode() for key in keys]


def agree(store: dist.Store, world: World, rows: RowFormat, timeout: float,
          transport: str) -> None:
    """Every rank must move the same rows over the same transport (gloo, NCCL), or the
    all-to-alls mis-size or never meet. This compares each rank's `rows.describe()` and
    `transport` through the rendezvous store.

    Raises:
        ValueError: the ranks differ; each is named with its rows.
    """
    store.set(f"rows/{world.rank}", f"{rows.describe()}, over {transport}")
    described = _wait_all(store, world, "rows", timeout, "for the row formats of")
    seen = {world.describe(r): what for r, what in enumerate(described)}
    # All have read before any raises: rank 0 hosts the store, and leaving early would
    # turn the others' clear error into a lost connection.
    store.set(f"rows_read/{world.rank}", "1")
    _wait_all(store, world, "rows_read", timeout, "for")
    if len(set(seen.values())) > 1:
        raise ValueError("the ranks move different rows (" + "; ".join(
            f"{who}: {what}" for who, what in seen.items()) + "): start every rank with the "
            "same --quantization, --dtype and --device")


def join(world: World, timeout: float, backend: str = "gloo",
         rows: RowFormat | None = None) -> None:
    """Rendezvous, check that every rank moves `rows` if given, then form the
    torch.distributed process group: gloo for CPU tensors, NCCL for CUDA ones."""
    store = rendezvous(world, timeout)
    if rows is not None:
        agree(store, world, rows, timeout, backend)
    dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size,
                            timeout=timedelta(seconds=timeout))


class Collective(Protocol):
    """The two collectives the lockstep exchange needs, over every rank of the world."""

    def agree_rounds(self, rounds: int, device: torch.device) -> int:
        """The most `rounds` of any rank, by an all-reduce (max). That is the step's
        micro-batches, or 0 where no rank has work."""
        ...

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor,
                   out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> None:
        """`dist.all_to_all_single`: rows of `inp` [sum(in_splits), ...] go to each rank,
        and rows from each rank come into `out` [sum(out_splits), ...]. None splits are
        equal."""
        ...

    def ready(self) -> bool:
        """Whether the communicator is up. A dead rank shows at the next collective."""
        ...

    def close(self) -> None:
        ...


class TorchCollective:
    """The collectives of the torch.distributed process group (`join`)."""

    def agree_rounds(self, rounds: int, device: torch.device) -> int:
        return agree_rounds(rounds, device)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor,
                   out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> None:
        dist.all_to_all_single(out, inp, output_split_sizes=out_splits,
                               input_split_sizes=in_splits)

    def start_all_to_all(self, out: torch.Tensor, inp: torch.Tensor,
                         out_splits: list[int] | None = None,
                         in_splits: list[int] | None = None) -> dist.Work:
        """`all_to_all` issued now, and waited on by the returned work's `wait()`. The
        tensors must live until then."""
        return dist.all_to_all_single(out, inp, output_split_sizes=out_splits,
                                      input_split_sizes=in_splits, async_op=True)

    def ready(self) -> bool:
        return dist.is_initialized()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def agree_rounds(rounds: int, device: torch.device) -> int:
    """The most `rounds` of any rank of the process group; 0 means no rank has work."""
    most = torch.tensor([rounds], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


class TorchExperts:
    """The attention side, an `ExpertsClient`, in lockstep with every other rank."""

    lockstep = True

    def __init__(self, world: World, placement: Placement, rows: RowFormat,
                 device: str = "cpu", collective: Collective | None = None,
                 backend: str = "torch") -> None:
        """`backend` is the name its dispatch and combine metrics carry."""
        if placement.num_ranks != world.num_experts:
            raise ValueError(f"placement has {placement.num_ranks} ranks, the world "
                             f"{world.num_experts} expert ranks")
        self.world, self.placement = world, placement
        self.format, self.device = rows, torch.device(device)
        self.width = placement.most_local
        self.coll = collective or TorchCollective()
        self.backend = backend
        self._turns = ReplicaTurns(world.rank)  # each layer's first replica, apart on each rank
        # this round's micro-batches, this rank's and the world's; no round is open yet
        self._mine = self._rounds = 0
        self._issued: dict[int, int] = {}  # this round's calls of this rank, per layer
        self._done: dict[int, int] = {}  # this round's exchanges, zero-row joins included
        self._layers = sorted(placement.replicas)

    @property
    def overlaps(self) -> bool:
        """Whether `start` returns before the expert ranks answer. It does with
        asynchronous collectives: torch.distributed's, and the CuPy communicator's on its
        own stream."""
        return hasattr(self.coll, "start_all_to_all")

    def round_trip_s(self) -> float | None:
        return None  # not measured through the collectives

    def begin_step(self, num_tokens: int, micro_batches: int = 1) -> bool:
        """Begin a new round: a step's decoder layers, or an MTP pass's layer. First the
        last round's layers that this rank did not call are joined with zero rows."""
        self._join_until(None)
        self._mine = micro_batches if num_tokens > 0 else 0
        self._rounds = self.coll.agree_rounds(self._mine, self.device)
        self._issued, self._done = {}, {}
        return self._rounds > 0

    def idle_step(self) -> None:
        self._join_until(None)

    def _join_until(self, layer: int | None) -> None:
        """Make, with zero rows, every exchange of this round's layers before `layer`
        (None: all of them) that this rank has not made. The expert ranks serve every layer
        of the placement each round, in order, and a round may call only some of them: a
        step calls the decoder's, an MTP pass its own."""
        for earlier in self._layers:
            if earlier == layer:
                return
            for _ in range(self._rounds - self._done.get(earlier, 0)):
                self._exchange(earlier, *self._nothing()).finish()
            self._done[earlier] = self._rounds

    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        return self.start(layer, x, topk_ids, topk_weights).finish()

    def start(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> TorchExchange:
        """A layer call in flight, with its collectives issued; `finish` waits on them. After
        this rank's last micro-batch of the layer, the rounds that other ranks' extra
        micro-batches take are joined with zero rows, so the layer's rounds end before
        any rank's next layer begins."""
        if not self._issued.get(layer):
            self._join_until(layer)
        exchange = self._exchange(layer, x, topk_ids, topk_weights)
        issued = self._issued[layer] = self._issued.get(layer, 0) + 1
        self._done[layer] = issued
        if issued == self._mine:
            self._done[layer] = self._rounds
            for _ in range(self._rounds - issued):
                self._exchange(layer, *self._nothing()).finish()
        return exchange

    def _nothing(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.format.empty_outputs(0, self.device)  # [0, H]
        return (x, torch.zeros(0, 1, dtype=torch.int64, device=self.device),
                torch.zeros(0, 1, dtype=x.dtype, device=self.device))

    def _exchange(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor) -> TorchExchange:
        """Issue one round of the layer: the row counts, so the expert ranks can size
        their buffers; the rows; and the outputs back, whose splits are this rank's own.
        The calls are asynchronous where the collective can be, else made each in turn."""
        layout = compute_layout(topk_ids, topk_weights, self.placement, layer,
                                self._turns(layer))
        g = self.world.num_attention
        counts = torch.zeros(self.world.size, self.width, dtype=torch.int64)
        for r, c in enumerate(layout.expert_counts):
            counts[g + r, :len(c)] = torch.tensor(c, dtype=torch.int64)
        counts = counts.to(x.device)
        splits = [0] * g + layout.rank_counts
        rows = self.format.rows(x)[layout.src_token].contiguous()  # [N, width] to send
        none = [0] * self.world.size
        y = self.format.empty_outputs(rows.shape[0], x.device)  # [N, H]
        calls = [(torch.empty_like(counts), counts, None, None),  # experts learn the layout
                 (self.format.empty_rows(0, x.device), rows, none, splits),
                 (y, self.format.empty_outputs(0, x.device), splits, none)]
        start = getattr(self.coll, "start_all_to_all", None)
        if start is not None:
            return TorchExchange(self.backend, layer, x, layout, y,
                                 [start(*call) for call in calls], calls)
        with phase("dispatch", self.backend, layer, x.shape[0]):
            for call in calls:
                self.coll.all_to_all(*call)
        return TorchExchange(self.backend, layer, x, layout, y, [], calls)

    def describe(self) -> list[str]:
        return [f"{self.world.describe(self.world.num_attention + r)} (world rank "
                f"{self.world.num_attention + r}): {sum(map(len, experts.values()))} experts "
                f"over {len(experts)} MoE layers, {self.format.describe()}"
                for r, experts in enumerate(map(self.placement.local_experts,
                                                range(self.world.num_experts)))]

    def ready(self) -> bool:
        # A dead rank breaks the collective: the next step fails and its requests get 503.
        return self.coll.ready()

    def close(self) -> None:
        self.coll.close()


class TorchExchange:
    """One round of a layer's exchange in flight.

    `finish` waits on its collectives, which is the attention service's bubble
    (`common.compute.waiting`), and combines the outputs y [N, H] into token order.
    `calls` keeps the collectives' tensors alive until then.
    """

    held_s = 0.0  # the expert ranks' time is not reported through the collectives

    def __init__(self, backend: str, layer: int, x: torch.Tensor, layout: Layout,
                 y: torch.Tensor, works: list[dist.Work], calls: list[tuple]) -> None:
        self.backend, self.layer, self.x, self.layout = backend, layer, x, layout
        self.y, self.works, self.calls = y, works, calls

    def finish(self) -> torch.Tensor:
        tokens = self.x.shape[0]
        if self.works:
            with phase("dispatch", self.backend, self.layer, tokens), waiting():
                for work in self.works:
                    work.wait()
        with phase("combine", self.backend, self.layer, tokens):
            return combine(self.y, self.layout)


def serve_round(world: World, placement: Placement, expert_fn: ExpertFn, rows: RowFormat,
                device: torch.device, coll: Collective) -> None:
    """One lockstep round on an expert rank: agree on the step's micro-batches, then serve
    every MoE layer that many times, or none if no attention rank has work."""
    rounds = coll.agree_rounds(0, device)
    rank, width = world.rank - world.num_attention, placement.most_local
    for layer in sorted(placement.replicas) if rounds else []:
        for _ in range(rounds):  # one per micro-batch, in the order they were issued
            _serve_layer(world, layer, expert_fn, rows, device, width,
                         placement.table(layer).num_local[rank], coll)


def serve_experts(world: World, placement: Placement, expert_fn: ExpertFn, rows: RowFormat,
                  device: str = "cpu", collective: Collective | None = None) -> None:
    """Expert side: serve every round until the process is stopped."""
    coll = collective or TorchCollective()
    while True:
        serve_round(world, placement, expert_fn, rows, torch.device(device), coll)


def _serve_layer(world: World, layer: int, expert_fn: ExpertFn, rows: RowFormat,
                 device: torch.device, width: int, num_local: int, coll: Collective) -> None:
    """One MoE layer's exchange on an expert rank: `width` count columns per rank, the
    first `num_local` of them this rank's experts'."""
    g = world.num_attention
    counts = torch.empty(world.size, width, dtype=torch.int64, device=device)
    coll.all_to_all(counts, torch.zeros(world.size, width, dtype=torch.int64, device=device))
    per_source = counts[:g, :num_local].cpu()  # [G, E_local] rows from each attention rank
    splits = per_source.sum(dim=1).tolist() + [0] * world.num_experts
    received = rows.empty_rows(sum(splits), device)  # [M, width]
    coll.all_to_all(received, rows.empty_rows(0, device), splits, [0] * world.size)
    if g == 1:  # one source: rows already arrive grouped by expert
        y = expert_fn(layer, received, per_source[0].tolist()).contiguous()  # [M, H]
    else:
        # Rows arrive source-major ([a][e]); the grouped GEMM wants expert-major ([e][a]).
        perm = _expert_major(per_source).to(device)  # [M]
        y = rows.empty_outputs(received.shape[0], device)  # [M, H]
        y[perm] = expert_fn(layer, received[perm], per_source.sum(dim=0).tolist())
    coll.all_to_all(rows.empty_outputs(0, device), y, [0] * world.size, splits)


def _expert_major(per_source: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder source-major rows into expert-major order, for
    per_source [G, E_local] row counts."""
    starts = (per_source.flatten().cumsum(0) - per_source.flatten()).view(per_source.shape)
    pieces = [torch.arange(int(starts[a, e]), int(starts[a, e] + per_source[a, e]))
              for e in range(per_source.shape[1]) for a in range(per_source.shape[0])]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
