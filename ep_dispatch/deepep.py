"""`deepep` backend: DeepEP's all-to-all kernels between attention and expert ranks.

DeepEP (github.com/deepseek-ai/DeepEP, its V1 `deep_ep.Buffer`) assumes symmetric expert
parallelism: each rank of the Buffer's group sends tokens and hosts num_experts / num_ranks
experts, expert e on rank e // experts_per_rank. Here attention ranks send and expert ranks
compute, so experts are renumbered into *slots*. Every world rank owns L slots, where L is
the most experts an expert rank holds in one MoE layer. Expert rank r's k-th local expert of
a layer is slot (G + r) * L + k, and no token is routed to the G attention ranks' slots.
Expert ranks dispatch one padding token routed nowhere (top-k ids -1), because DeepEP has
crashed on ranks with no tokens.

Every round starts with an all-reduce of the largest token count of any attention rank,
which picks the kernels for all ranks (`--deepep-mode auto`). The low-latency kernels run
when it fits `--deepep-max-tokens`, as in decode steps; otherwise the normal ones run, as in
prefill steps.

- normal: `get_dispatch_layout`, then `dispatch` sends each token once to each rank it
  needs, with its top-k local slots and weights. The expert rank runs every (token, slot)
  pair and sums them per token, weighted. `combine`, a plain sum, brings them back.
- low latency: `low_latency_dispatch` (bf16) fills [L, max_tokens * W, H] per-slot rows
  with counts. The expert rank runs its grouped GEMM on each slot's rows, writing the
  outputs in place. `low_latency_combine` sums them weighted by the sender's top-k weights.

The handle of each dispatch is used by its combine, and layouts are computed once per layer
call. DeepEP's receive hook (`return_recv_hook`) is not used. It frees a rank to do other
work while a low-latency exchange is in flight, and an attention rank here has none to do
then. The models served have no shared experts, which in DeepSeek's style would be that
work, and two-micro-batch overlap of the attention step is not built.

It was tested across 4 processes over a CPU double of DeepEP's API
(tests/support/deepep_fake.py), written from DeepEP's source apart from the backend. It has
not yet run with DeepEP itself, which the lent GPU machine lacks (docs/benchmarks.md).

`deepep` needs `--device cuda` and bfloat16. Its limits are checked before any process
starts (`deepep_config`): hidden sizes, top-k, rank counts, tokens per rank against
NVSHMEM's queue depth, and experts per rank. The RDMA buffer's size across nodes is checked
once DeepEP gives its size hints. It refuses w4a4 at start-up, as DeepEP's kernels take
bf16 or FP8 rows. It also refuses MTP drafts, as its rounds take the decoder's layers only;
n-gram drafts work. Its rounds
all-reduce the largest token count rather than a flag, so every rank picks the same kernels.
It does not split steps into micro-batches yet.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ep_dispatch.base import ExpertFn
from ep_dispatch.deepep_config import (
    MODES,
    DeepEPSettings,
    check_rdma_bytes,
    check_slots_fit,
    import_deep_ep,
)
from ep_dispatch.layout import ReplicaTurns
from ep_dispatch.metrics import phase
from ep_dispatch.placement import Placement
from ep_dispatch.torch_dist import World

log = logging.getLogger(__name__)

# (rows [M, H] grouped by local slot, rows per local slot) -> outputs [M, H], unweighted
SlotFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


class Slots:
    """DeepEP's expert ids for our placement: per MoE layer, each expert's slot for each of
    its replicas, and how many replicas it has."""

    def __init__(self, placement: Placement, num_attention: int, device: torch.device) -> None:
        self.per_rank = placement.most_local  # L
        self.num_slots = (num_attention + placement.num_ranks) * self.per_rank
        self._slot: dict[int, torch.Tensor] = {}
        self._replicas: dict[int, torch.Tensor] = {}
        for layer in placement.replicas:
            t = placement.table(layer)
            ranks = t.replica_ranks  # [E, R_max] expert ranks
            local = t.local_index.gather(0, ranks.T).T  # [E, R_max] index on that rank
            self._slot[layer] = ((num_attention + ranks) * self.per_rank + local).to(device)
            self._replicas[layer] = t.num_replicas.to(device)

    def route(self, layer: int, topk_ids: torch.Tensor, first_replica: int = 0
              ) -> torch.Tensor:
        """Slots [T, K] int64 of global expert ids [T, K]; token t takes replica
        (first_replica + t) % num_replicas, as the other backends do."""
        token = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]  # [T, 1]
        replica = (token + first_replica) % self._replicas[layer][topk_ids]  # [T, K]
        return self._slot[layer][topk_ids, replica]


def weighted_by_slot(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                     per_slot: list[int], fn: SlotFn) -> torch.Tensor:
    """What an expert rank returns for normal-mode rows: per row, the sum over its local
    slots of weight * fn(row).

    Args:
        x: [M, H] received rows.
        slots: [M, K] int64 local slot of each of a row's top-k choices, -1 where that
            choice is on another rank.
        weights: [M, K] float32 router weights.
        per_slot: rows per local slot (DeepEP's num_recv_tokens_per_expert_list).
        fn: the experts: rows grouped by local slot -> outputs [M', H], unweighted.

    Returns:
        [M, H] in x's dtype, summed in float32.
    """
    n = sum(per_slot)
    if n == 0:
        return torch.zeros_like(x)
    top_k = slots.shape[1]
    flat = slots.reshape(-1)  # [M*K]
    key = torch.where(flat >= 0, flat, len(per_slot))  # others' choices sort last
    pairs = torch.argsort(key, stable=True)[:n]  # [n] (row, choice) pairs by slot
    rows = pairs // top_k  # [n]
    y = fn(x[rows], per_slot)  # [n, H]
    w = weights.reshape(-1)[pairs].to(torch.float32)[:, None]  # [n, 1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [M, H]
    return out.index_add_(0, rows, y.float() * w).to(x.dtype)


def packed_rows(packed: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Low-latency receive buffer [L, cap, H] -> its valid rows [sum(counts), H], by slot."""
    parts = [packed[s, :c] for s, c in enumerate(counts) if c]
    return torch.cat(parts) if parts else packed.new_zeros(0, packed.shape[-1])


def unpack_into(packed: torch.Tensor, counts: list[int], y: torch.Tensor) -> None:
    """Write y [sum(counts), H] back into packed [L, cap, H], slot by slot."""
    start = 0
    for s, c in enumerate(counts):
        if c:
            packed[s, :c] = y[start:start + c]
            start += c


class DeepEPRank:
    """One rank of the Buffer's world. Attention ranks send tokens (`slot_fn` None), and
    expert ranks run their slots (`slot_fn(layer)`). `device` is this process's GPU; the
    tests give the CPU, with a CPU double of `deep_ep` over gloo."""

    def __init__(self, world: World, placement: Placement, hidden: int, top_k: int,
                 settings: DeepEPSettings, slot_fn: Callable[[int], SlotFn] | None = None,
                 device: torch.device | None = None) -> None:
        self.deep_ep = import_deep_ep()
        self.world, self.hidden, self.top_k, self.settings = world, hidden, top_k, settings
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.slots = Slots(placement, world.num_attention, self.device)
        if self.device.type == "cuda":
            check_slots_fit(settings, self.slots.num_slots, torch.cuda.get_device_properties(
                self.device).multi_processor_count)
        self.idx_dtype = getattr(self.deep_ep, "topk_idx_t", torch.int64)
        self.layers = sorted(placement.replicas)
        self.slot_fn = slot_fn
        _agree(settings, hidden, top_k, self.slots.per_rank, self.device)
        self.buffer = self._buffer()
        self.mode, self._ll_clean = "normal", False
        self._turns = ReplicaTurns(world.rank)  # each layer's first replica, apart on each rank

    def _buffer(self) -> Any:
        Buffer, s, w = self.deep_ep.Buffer, self.settings, self.world.size
        hidden_bytes = self.hidden * 2
        configs = []
        if s.mode != "low_latency":
            try:  # this DeepEP's tuned configs cover the rank counts it supports
                configs = [Buffer.get_dispatch_config(w), Buffer.get_combine_config(w)]
            except AssertionError:
                raise ValueError(f"this DeepEP has no normal-kernel configs for {w} ranks; "
                                 f"use another layout or --deepep-mode low_latency") from None
        nvl = s.nvl_bytes or max((c.get_nvl_buffer_size_hint(hidden_bytes, w)
                                  for c in configs), default=0)
        hints = [Buffer.get_low_latency_rdma_size_hint(
            s.max_tokens, self.hidden, w, self.slots.num_slots)] if s.low_latency else []
        if w > 8:
            hints += [c.get_rdma_buffer_size_hint(hidden_bytes, w) for c in configs]
        rdma = s.rdma_bytes or max(hints, default=0)
        check_rdma_bytes(s, w, rdma)
        log.info("DeepEP buffer: %d ranks, %d slots each, NVLink %.0f MB, RDMA %.0f MB, "
                 "mode %s", w, self.slots.per_rank, nvl / 1e6, rdma / 1e6, s.mode)
        # queue pairs: the low-latency kernels need one per local expert, the normal
        # internode ones one per channel (num_sms / 2), as DeepEP's own tests give
        self._explicit = "explicitly_destroy" in inspect.signature(Buffer).parameters
        extra = {"explicitly_destroy": True} if self._explicit else {}
        return Buffer(dist.group.WORLD, nvl, rdma, low_latency_mode=s.low_latency,
                      num_qps_per_rank=max(self.slots.per_rank, Buffer.num_sms), **extra)

    def begin_round(self, num_tokens: int) -> bool:
        """The round's kernels, chosen from every rank's token count by a collective."""
        most = torch.tensor([num_tokens], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        tokens = int(most.item())
        if self.settings.mode == "auto":
            self.mode = "low_latency" if tokens <= self.settings.max_tokens else "normal"
        else:
            self.mode = self.settings.mode
        return tokens > 0

    def layer(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
        """One MoE layer's exchange: x [T, H] bf16 routed to topk_ids [T, K] -> [T, H]."""
        if x.shape[0] == 0:
            return self.idle_layer(layer)
        slots = self.slots.route(layer, topk_ids, self._turns(layer))  # [T, K]
        slots = slots.to(self.idx_dtype).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()  # [T, K]
        return self._exchange(layer, x.contiguous(), slots, weights)

    def idle_layer(self, layer: int) -> torch.Tensor:
        """This rank's part of a layer's exchange without tokens of its own: one padding
        token routed nowhere, since DeepEP has failed on empty ranks. Returns [0, H]."""
        d, k = self.device, self.top_k
        return self._exchange(layer, torch.zeros(1, self.hidden, dtype=torch.bfloat16, device=d),
                              torch.full((1, k), -1, dtype=self.idx_dtype, device=d),
                              torch.zeros(1, k, dtype=torch.float32, device=d))[:0]

    def _exchange(self, layer: int, x: torch.Tensor, slots: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
        fn = self.slot_fn(layer) if self.slot_fn else None
        if self.mode == "low_latency":
            return self._low_latency(x, slots, weights, layer, fn)
        return self._normal(x, slots, weights, fn)

    def _normal(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                fn: SlotFn | None) -> torch.Tensor:
        b = self.buffer
        self._ll_clean = False
        per_rank, per_rdma_rank, per_slot, in_rank, _ = b.get_dispatch_layout(
            slots, self.slots.num_slots)  # per_rdma_rank: None on one node
        recv_x, recv_slots, recv_w, recv_per_slot, handle, _ = b.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_slot, topk_idx=slots,
            topk_weights=weights)
        y = weighted_by_slot(recv_x, recv_slots, recv_w, recv_per_slot, fn) if fn \
            else torch.zeros_like(recv_x)  # [M, H]; attention ranks receive no rows
        combined, _, _ = b.combine(y, handle)
        return combined

    def _low_latency(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor,
                     layer: int, fn: SlotFn | None) -> torch.Tensor:
        b, s = self.buffer, self.settings
        if not self._ll_clean:  # after normal kernels, before low-latency ones
            b.clean_low_latency_buffer(s.max_tokens, self.hidden, self.slots.num_slots)
            self._ll_clean = True
        packed, counts, handle, _, _ = b.low_latency_dispatch(
            x, slots, s.max_tokens, self.slots.num_slots, use_fp8=False)
        if fn:  # packed [L, max_tokens * W, H], counts [L]
            n = counts.tolist()
            unpack_into(packed, n, fn(packed_rows(packed, n), n))
        combined, _, _ = b.low_latency_combine(packed, slots, weights, handle)
        return combined

    def close(self) -> None:
        if self._explicit:  # collective, and before the process group goes
            self.buffer.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()


_AGREED = ("mode", "max tokens", "NVLink bytes", "RDMA bytes", "hidden", "top-k",
           "slots per rank")


def _agree(settings: DeepEPSettings, hidden: int, top_k: int, per_rank: int,
           device: torch.device) -> None:
    """Every rank must size DeepEP alike, since different max tokens hang its kernels. The
    sizes are all-gathered as integers, in a tensor like every other exchange here.

    Raises:
        ValueError: the ranks differ; each rank's values are named.
    """
    mine = torch.tensor([MODES.index(settings.mode), settings.max_tokens, settings.nvl_bytes,
                         settings.rdma_bytes, hidden, top_k, per_rank], device=device)  # [7]
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    values = [t.tolist() for t in everyone]
    if any(v != values[0] for v in values):
        raise ValueError("the ranks' DeepEP settings differ (give every rank the same "
                         "--deepep-* flags): " + "; ".join(
                             f"rank {r}: {_described(v)}" for r, v in enumerate(values)))


def _described(values: list[int]) -> str:
    return ", ".join(f"{name} {MODES[x] if name == 'mode' else x}"
                     for name, x in zip(_AGREED, values, strict=True))


class DeepEPExperts:
    """The attention side, an `ExpertsClient`, in lockstep with every other rank."""

    lockstep = True

    def __init__(self, world: World, placement: Placement, hidden: int, top_k: int,
                 settings: DeepEPSettings, device: torch.device | None = None) -> None:
        self.rank = DeepEPRank(world, placement, hidden, top_k, settings, device=device)

    def begin_step(self, num_tokens: int, micro_batches: int = 1) -> bool:
        return self.rank.begin_round(num_tokens)  # no `start`: one micro-batch a step

    def idle_step(self) -> None:
        for layer in self.rank.layers:
            self.rank.idle_layer(layer)

    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        with phase("dispatch", "deepep", layer, x.shape[0]):  # dispatch + combine
            return self.rank.layer(layer, x, topk_ids, topk_weights)

    def describe(self) -> list[str]:
        w = self.rank.world
        return [f"DeepEP world of {w.size} ranks: {w.num_attention} attention, "
                f"{w.num_experts} expert; {self.rank.slots.per_rank} slots per rank"]

    def ready(self) -> bool:
        return dist.is_initialized()

    def close(self) -> None:
        self.rank.close()


def serve_deepep(world: World, placement: Placement, expert_fn: ExpertFn, hidden: int,
                 top_k: int, settings: DeepEPSettings, device: torch.device | None = None
                 ) -> None:
    """Expert side: every round, each MoE layer's exchange, until the process is stopped."""
    rank_index = world.rank - world.num_attention

    def slot_fn(layer: int) -> SlotFn:
        num_local = placement.table(layer).num_local[rank_index]

        def run(rows: torch.Tensor, per_slot: list[int]) -> torch.Tensor:
            if any(per_slot[num_local:]):
                raise RuntimeError(f"layer {layer}: rows for slots this rank does not hold")
            return expert_fn(layer, rows, per_slot[:num_local])

        return run

    rank = DeepEPRank(world, placement, hidden, top_k, settings, slot_fn, device)
    while True:
        if rank.begin_round(0):
            for layer in rank.layers:
                rank.idle_layer(layer)
