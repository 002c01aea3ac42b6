"""`deepep` backend: DeepEP's all-to-all kernels between attention and expert ranks.

DeepEP (github.com/deepseek-ai/DeepEP, its V1 `deep_ep.Buffer`) assumes symmetric expert
parallelism: each rank of the Buffer's group sends tokens and hosts num_experts / num_ranks
experts, expert e on rank e // experts_per_rank. Here attention ranks send and expert ranks
compute, so experts are renumbered into *slots*: every world rank owns L slots (L = the
most experts an expert rank holds in one MoE layer), expert rank r's k-th local expert of a
layer is slot (G + r) * L + k, and no token is routed to the G attention ranks' slots.
Expert ranks dispatch one padding token routed nowhere (top-k ids -1), because DeepEP has
crashed on ranks with no tokens.

Every round starts with an all-reduce of the largest token count of any attention rank,
which picks the kernels for all ranks (`--deepep-mode auto`): the low-latency kernels when
it fits `--deepep-max-tokens` (decode steps), else the normal ones (prefill steps).

- normal: `get_dispatch_layout`, then `dispatch` sends each token once to each rank it
  needs, with its top-k local slots and weights; the expert rank runs every (token, slot)
  pair and sums them per token, weighted; `combine` (a plain sum) brings them back.
- low latency: `low_latency_dispatch` (bf16) fills [L, max_tokens * W, H] per-slot rows
  with counts; the expert rank runs its grouped GEMM on each slot's rows, writing the
  outputs in place; `low_latency_combine` sums them weighted by the sender's top-k weights.

The handle of each dispatch is used by its combine; layouts are computed once per layer
call. DeepEP's receive hook (`return_recv_hook`) is not used: it frees a rank to do other
work while a low-latency exchange is in flight, and an attention rank here has none to do
then. The models served have no shared experts (DeepSeek-style ones would be that work),
and two-micro-batch overlap of the attention step is not built.

Tested across processes over a CPU double of DeepEP's API (tests/deepep_fake.py); not yet
run with DeepEP itself, which the lent GPU machine lacks (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ep_dispatch.base import ExpertFn
from ep_dispatch.layout import ReplicaTurns
from ep_dispatch.metrics import phase
from ep_dispatch.placement import Placement
from ep_dispatch.torch_dist import World
from switchyard.flags import env
from switchyard.units import parse_size

log = logging.getLogger(__name__)

# DeepEP's constraints (deepseek-ai/DeepEP: csrc/kernels/launch.cuh SWITCH_HIDDEN and
# SWITCH_RANKS, intranode.cu notify_dispatch, internode_ll.cu, deep_ep.cpp), checked before
# any process group exists. 3072 needs DeepEP from October 2025 on (its PR #458).
LOW_LATENCY_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)  # 6144: its PR #329
MAX_TOP_K = 9  # kNumMaxTopK of the low-latency kernels (11 in newer DeepEP)
QP_DEPTH = 1024  # NVSHMEM_QP_DEPTH's default: low latency needs (tokens + 1) * 2 <= it
INTRANODE_RANKS = (2, 4, 8)
INTERNODE_NODES = (2, 4, 8, 16)  # of 8 ranks each (SWITCH_RDMA_RANKS)
MAX_SLOTS_INTRANODE = 128  # experts per rank, normal kernels on one node (notify_dispatch)
# normal kernels across nodes: notify_dispatch gives each of its 512 threads one of a node's
# experts (8 ranks x L <= 512), and indexes the RDMA buffer with an int
MAX_SLOTS_INTERNODE = 64
MAX_INTERNODE_RDMA_BYTES = 2**31 - 2  # `num_rdma_bytes < INT_MAX` (internode.cu)
MAX_SLOTS = 1024  # NUM_MAX_LOCAL_EXPERTS
MAX_WARP_GROUPS = 14  # low latency: cdiv(slots of all ranks, SMs) < 15
BUFFER_ALIGNMENT = 128  # bytes
MODES = ("auto", "normal", "low_latency")
BUILD_HINT = ("build it from https://github.com/deepseek-ai/DeepEP with NVSHMEM (pip install "
              "nvidia-nvshmem-cu12, then `pip install --no-build-isolation .` in its "
              "checkout), or build the image with --build-arg WITH_DEEPEP=1")

# (rows [M, H] grouped by local slot, rows per local slot) -> outputs [M, H], unweighted
SlotFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True)
class DeepEPSettings:
    """The `--deepep-*` flags; every rank of the world must be given the same."""

    mode: str = "auto"  # auto: low latency when a round's tokens fit max_tokens, else normal
    max_tokens: int = 128  # low latency: the most tokens one attention rank sends per round
    nvl_bytes: int = 0  # the Buffer's NVLink buffer; 0: DeepEP's size hint
    rdma_bytes: int = 0  # its RDMA buffer; 0: DeepEP's size hint

    @property
    def low_latency(self) -> bool:
        return self.mode != "normal"


def add_deepep_flags(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        p.add_argument("--deepep-mode", default=env("DEEPEP_MODE", "auto"), choices=MODES,
                       help="deepep backend: its low-latency kernels for rounds of at most "
                            "--deepep-max-tokens tokens per attention rank and normal ones "
                            "above (auto), or one kind always"),
        p.add_argument("--deepep-max-tokens", type=int,
                       default=int(env("DEEPEP_MAX_TOKENS", "128")),
                       help="deepep: tokens per attention rank the low-latency buffers hold"),
        p.add_argument("--deepep-nvl-bytes", type=parse_size,
                       default=parse_size(env("DEEPEP_NVL_BYTES", "0")),
                       help="deepep: NVLink buffer per rank (0: DeepEP's size hint)"),
        p.add_argument("--deepep-rdma-bytes", type=parse_size,
                       default=parse_size(env("DEEPEP_RDMA_BYTES", "0")),
                       help="deepep: RDMA buffer per rank (0: DeepEP's size hint)"),
    ]


def deepep_settings(args: argparse.Namespace) -> DeepEPSettings:
    return DeepEPSettings(args.deepep_mode, args.deepep_max_tokens, args.deepep_nvl_bytes,
                          args.deepep_rdma_bytes)


def deepep_flags(s: DeepEPSettings) -> list[str]:
    """The flags that give another process these settings."""
    return ["--deepep-mode", s.mode, "--deepep-max-tokens", str(s.max_tokens),
            "--deepep-nvl-bytes", str(s.nvl_bytes), "--deepep-rdma-bytes", str(s.rdma_bytes)]


def check_deepep(s: DeepEPSettings, world_size: int, hidden: int, top_k: int,
                 slots_per_rank: int, dtype: torch.dtype) -> None:
    """Refuse, before anything starts, what DeepEP's kernels cannot run."""
    if s.mode not in MODES:
        raise ValueError(f"unknown --deepep-mode {s.mode!r}; choose {', '.join(MODES)}")
    if dtype != torch.bfloat16:
        raise ValueError(f"the deepep backend moves bfloat16 rows; this model computes in "
                         f"{dtype} (use --dtype bfloat16 or auto on the GPU)")
    if hidden % 8:
        raise ValueError(f"DeepEP moves rows in 16-byte units; hidden size {hidden} is not "
                         "a multiple of 8")
    if slots_per_rank > MAX_SLOTS:
        raise ValueError(f"an expert rank holds {slots_per_rank} experts of one layer; "
                         f"DeepEP allows {MAX_SLOTS}: use more expert ranks")
    for name, size in (("nvl", s.nvl_bytes), ("rdma", s.rdma_bytes)):
        if size % BUFFER_ALIGNMENT:
            raise ValueError(f"--deepep-{name}-bytes must be a multiple of "
                             f"{BUFFER_ALIGNMENT}; got {size}")
    if world_size > 8 and world_size % 8:
        raise ValueError(f"DeepEP runs more than 8 ranks only as 8 per node; this layout "
                         f"has {world_size} (attention and expert ranks together)")
    if s.mode != "low_latency":
        _check_normal(world_size, slots_per_rank)
        check_rdma_bytes(s, world_size, s.rdma_bytes)
    if s.low_latency:
        _check_low_latency(s, world_size, hidden, top_k)


def _check_normal(world_size: int, slots_per_rank: int) -> None:
    fix = "; or run --deepep-mode low_latency"
    if world_size <= 8 and world_size not in INTRANODE_RANKS:
        raise ValueError(f"DeepEP's normal kernels run on {INTRANODE_RANKS} ranks in one "
                         f"node; this layout has {world_size} (attention and expert ranks "
                         f"together){fix}")
    if world_size > 8 and world_size // 8 not in INTERNODE_NODES:
        raise ValueError(f"DeepEP's normal kernels run on {INTERNODE_NODES} nodes of 8 "
                         f"ranks; this layout has {world_size} ranks{fix}")
    if world_size <= 8 and slots_per_rank > MAX_SLOTS_INTRANODE:
        raise ValueError(f"an expert rank holds {slots_per_rank} experts of one layer; "
                         f"DeepEP's normal kernels on one node allow {MAX_SLOTS_INTRANODE}: "
                         f"use more expert ranks")
    if world_size > 8 and slots_per_rank > MAX_SLOTS_INTERNODE:
        raise ValueError(f"an expert rank holds {slots_per_rank} experts of one layer; "
                         f"DeepEP's normal kernels across nodes allow {MAX_SLOTS_INTERNODE}: "
                         f"use more expert ranks{fix}")


def check_rdma_bytes(s: DeepEPSettings, world_size: int, rdma_bytes: int) -> None:
    """Across nodes the normal kernels index the RDMA buffer with an int: it must stay
    below 2 GiB, the low-latency part that `auto` mode adds to it included."""
    if world_size > 8 and s.mode != "low_latency" and rdma_bytes > MAX_INTERNODE_RDMA_BYTES:
        raise ValueError(f"DeepEP's normal kernels across nodes take an RDMA buffer below "
                         f"2 GiB; this one is {rdma_bytes} bytes (--deepep-rdma-bytes, or "
                         f"the low-latency buffers of --deepep-max-tokens {s.max_tokens}): "
                         f"lower --deepep-max-tokens, or run one --deepep-mode")


def _check_low_latency(s: DeepEPSettings, world_size: int, hidden: int, top_k: int) -> None:
    fix = "; or run --deepep-mode normal"
    if hidden not in LOW_LATENCY_HIDDEN:
        raise ValueError(f"DeepEP's low-latency kernels support hidden sizes "
                         f"{', '.join(map(str, LOW_LATENCY_HIDDEN))}; this model's is "
                         f"{hidden}{fix}")
    if top_k > MAX_TOP_K:
        raise ValueError(f"DeepEP's low-latency kernels route each token to at most "
                         f"{MAX_TOP_K} experts; this model's top-k is {top_k}{fix}")
    depth = int(os.environ.get("NVSHMEM_QP_DEPTH", QP_DEPTH))  # as DeepEP reads it
    most = depth // 2 - 1
    if not 1 <= s.max_tokens <= most:
        raise ValueError(f"--deepep-max-tokens must be 1..{most} (DeepEP with NVSHMEM's queue "
                         f"depth {depth}, NVSHMEM_QP_DEPTH); got {s.max_tokens}")
    if s.max_tokens * world_size % 4:
        raise ValueError(f"DeepEP needs --deepep-max-tokens x ranks to be a multiple of 4; "
                         f"{s.max_tokens} x {world_size} is not")


def check_slots_fit(s: DeepEPSettings, num_slots: int, num_sms: int) -> None:
    """Low latency: DeepEP gives each SM at most 14 groups of experts to serve."""
    if s.low_latency and -(-num_slots // num_sms) > MAX_WARP_GROUPS:
        raise ValueError(f"DeepEP's low-latency kernels serve at most {MAX_WARP_GROUPS} x "
                         f"{num_sms} SMs experts; the world's {num_slots} expert slots (every "
                         f"rank holds as many as the fullest expert rank) are more: use more "
                         f"expert ranks or --deepep-mode normal")


def check_step_budget(s: DeepEPSettings, max_num_batched_tokens: int) -> None:
    """With low-latency kernels only, no step may send more tokens than they hold."""
    if s.mode == "low_latency" and max_num_batched_tokens > s.max_tokens:
        raise ValueError(f"--deepep-mode low_latency holds {s.max_tokens} tokens per rank "
                         f"(--deepep-max-tokens) but a step may run "
                         f"{max_num_batched_tokens} (--max-num-batched-tokens)")


def import_deep_ep() -> Any:
    """`deep_ep`, or an error that says how to get it."""
    try:
        import deep_ep
    except ImportError as exc:
        raise ValueError(f"the deepep dispatch backend needs DeepEP (import deep_ep failed: "
                         f"{exc}); {BUILD_HINT}") from exc
    if getattr(deep_ep, "Buffer", None) is None:  # built with DISABLE_LEGACY
        raise ValueError(f"the deepep dispatch backend needs DeepEP's Buffer (V1 API), which "
                         f"this build of deep_ep lacks; {BUILD_HINT}")
    return deep_ep


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
    """One rank of the Buffer's world: attention ranks send tokens (`slot_fn` None), expert
    ranks run their slots (`slot_fn(layer)`). `device` is this process's GPU; the tests
    give the CPU, with a CPU double of `deep_ep` over gloo."""

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
        self._turns = ReplicaTurns(world.rank)  # each layer's first replica; ranks apart

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
        """The round's kernels, from every rank's token count (collective)."""
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
        token routed nowhere (DeepEP has failed on empty ranks). Returns [0, H]."""
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
    """Every rank must size DeepEP alike (different max tokens hang its kernels): the
    sizes are all-gathered as integers (a tensor, as every other exchange here).

    Raises:
        ValueError: the ranks differ (each rank's values named).
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
    """Attention side (`ExpertsClient`), in lockstep with every other rank."""

    lockstep = True

    def __init__(self, world: World, placement: Placement, hidden: int, top_k: int,
                 settings: DeepEPSettings, device: torch.device | None = None) -> None:
        self.rank = DeepEPRank(world, placement, hidden, top_k, settings, device=device)

    def begin_step(self, num_tokens: int) -> bool:
        return self.rank.begin_round(num_tokens)

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
