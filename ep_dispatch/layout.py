"""Where each routed row goes: the layout computed once per layer call, reused by combine.

Rows are the T*K (token, choice) pairs of a router's top-k. Each goes to one replica of
its expert; rows are ordered by (rank, local expert), so each rank's share is one
contiguous slice already grouped the way its grouped GEMM wants it.

A row goes to replica `(turn + token) % replicas` of its expert. The client's turn for that
layer moves on with each call, so that decode steps of one token spread too. The layout
keeps its counts per rank and per local expert on the device. `local` uses the same
`Layout`, of one rank holding every expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ep_dispatch.placement import Placement
from moe_kernels.cpu_kernels import cpu_kernels


@dataclass(frozen=True)
class Layout:
    """The dispatch plan of one layer call: DeepEP's "layout", before the data and the
    handle. Every backend has one, the in-process `local` one included, where one rank
    holds every expert.

    Attributes:
        src_token: [N] int64, the source token of each dispatched row, in send order.
        weights: [N] router weight of each row (applied by `combine`).
        counts: [R, E] int64 on the rows' device: rows for each rank's local experts, in
            local order. A rank's slots past its `num_local` stay 0. A CUDA graph reads it
            on the device, as a graph must not copy to the host.
        num_local: R ints, the experts each rank holds.
        num_tokens: T.
    """

    src_token: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    num_local: list[int]
    num_tokens: int

    @cached_property
    def expert_counts(self) -> list[list[int]]:
        """Per rank, rows for each of its local experts. This is the one copy to the host,
        which the transfers need."""
        return [c[:n] for c, n in zip(self.counts.tolist(), self.num_local, strict=True)]

    @cached_property
    def rank_counts(self) -> list[int]:
        """Rows sent to each expert rank: R ints, summing to N."""
        return [sum(c) for c in self.expert_counts]


class ReplicaTurns:
    """A client's `first_replica` for its next call to each layer.

    There is one turn per layer, moved on by each call. One shared counter would give a
    layer the same turn every step whenever the number of MoE layers is a multiple of the
    replica count.
    """

    def __init__(self, start: int = 0) -> None:
        self._start, self._next = start, {}

    def __call__(self, layer: int) -> int:
        turn = self._next.get(layer, self._start)
        self._next[layer] = turn + 1
        return turn


def compute_layout(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, placement: Placement, layer: int,
    first_replica: int = 0,
) -> Layout:
    """Plan the rows of topk_ids [T, K] (global expert ids) and topk_weights [T, K] on
    their device. There is one copy to the host: the row counts, which the transfers need.

    Token t takes replica (first_replica + t) % R of its expert. Callers rotate
    `first_replica` from call to call, or a decode step of one token would always take the
    first replica.
    """
    top_k = topk_ids.shape[1]
    device = topk_ids.device
    table = placement.table(layer, device)
    flat = topk_ids.reshape(-1)  # [T*K]
    token = torch.arange(flat.numel(), device=device) // top_k  # [T*K]
    replica = (token + first_replica) % table.num_replicas[flat]  # [T*K]
    rank = table.replica_ranks[flat, replica]  # [T*K]
    local = table.local_index[rank, flat]  # [T*K]
    return sort_rows(rank * placement.num_experts + local, topk_weights, table.num_local,
                     placement.num_experts)


def sort_rows(key: torch.Tensor, topk_weights: torch.Tensor, num_local: list[int],
              num_experts: int) -> Layout:
    """The layout of the rows of topk_weights [T, K] whose destination slots are key
    [T*K] int64 (rank * E + local expert). All of it stays on the device, with no host
    synchronisation."""
    num_tokens, top_k = topk_weights.shape
    slots = len(num_local) * num_experts
    if key.device.type == "cpu" and topk_weights.dtype == torch.float32 \
            and (kernels := cpu_kernels()) is not None:  # one call for the seven below
        src, weights, counts = kernels.sort_rows_cpu(key, topk_weights, slots)
        return Layout(src_token=src, weights=weights,
                      counts=counts.view(len(num_local), num_experts), num_local=num_local,
                      num_tokens=num_tokens)
    order = torch.argsort(key, stable=True)  # [T*K]
    # not bincount: on a GPU it synchronises twice to size its output
    counts = torch.zeros(slots, dtype=torch.int64,
                         device=key.device).index_add_(0, key, torch.ones_like(key))
    return Layout(src_token=order // top_k, weights=topk_weights.reshape(-1)[order],
                  counts=counts.view(len(num_local), num_experts), num_local=num_local,
                  num_tokens=num_tokens)


def combine(y: torch.Tensor, layout: Layout) -> torch.Tensor:
    """out [T, H] = sum over each token's rows of weight * y, for y [N, H] in send order,
    in y's dtype. As in DeepEP's combine, it sums in float32 and rounds once, not K times.
    In float32 on the CPU it is one compiled call (`combine_f32`) instead of five
    operations."""
    if y.dtype == torch.float32 and y.device.type == "cpu" and y.dim() == 2 \
            and y.stride(1) == 1 and (kernels := cpu_kernels()) is not None:
        return kernels.combine_f32(y, layout.src_token, layout.weights.float(),
                                   layout.num_tokens)
    out = torch.zeros(layout.num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    out.index_add_(0, layout.src_token, y.float() * layout.weights.float()[:, None])
    return out.to(y.dtype)
