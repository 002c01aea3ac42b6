"""The `deepep` backend's settings, the `--deepep-*` flags, and DeepEP's constraints on
them. They are checked at start-up, before any process group exists. Importing this needs
neither torch nor DeepEP, so `switchyard serve` checks them before starting anything."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.flags import env
from common.units import parse_size

if TYPE_CHECKING:
    import torch

# DeepEP's constraints, checked before any process group exists. They come from
# deepseek-ai/DeepEP: csrc/kernels/launch.cuh SWITCH_HIDDEN and SWITCH_RANKS, intranode.cu
# notify_dispatch, internode_ll.cu and deep_ep.cpp. 3072 needs DeepEP from October 2025 on
# (its PR #458).
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
    import torch

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
