"""Where each routed row goes: the layout computed once per layer call, reused by combine.

Rows are the T*K (token, choice) pairs of a router's top-k. Each goes to one replica of
its expert; rows are ordered by (rank, local expert), so each rank's share is one
contiguous slice already grouped the way its grouped GEMM wants it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ep_dispatch.placement import Placement


@dataclass(frozen=True)
class Layout:
    """The dispatch plan of one layer call (DeepEP's "layout", then data, then a handle).

    Attributes:
        src_token: [N] int64, the source token of each dispatched row, in send order.
        weights: [N] router weight of each row (applied by `combine`).
        rank_counts: rows sent to each expert rank (length num_ranks, sums to N).
        expert_counts: per rank, rows for each of its local experts (in local order).
        num_tokens: T.
    """

    src_token: torch.Tensor
    weights: torch.Tensor
    rank_counts: list[int]
    expert_counts: list[list[int]]
    num_tokens: int


class ReplicaTurns:
    """A client's `first_replica` for its next call to each layer: one turn per layer,
    moved on by each call (one shared counter would give a layer the same turn every step
    whenever the number of MoE layers is a multiple of the replica count)."""

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
    their device, with one copy to the host: the row counts, which the transfers need.
    Token t takes replica (first_replica + t) % R of its expert: callers rotate
    `first_replica` from call to call, or a decode step of one token would always take
    the first replica."""
    num_tokens, top_k = topk_ids.shape
    device = topk_ids.device
    table = placement.table(layer, device)
    flat = topk_ids.reshape(-1)  # [T*K]
    token = torch.arange(flat.numel(), device=device) // top_k  # [T*K]
    replica = (token + first_replica) % table.num_replicas[flat]  # [T*K]
    rank = table.replica_ranks[flat, replica]  # [T*K]
    local = table.local_index[rank, flat]  # [T*K]
    key = rank * placement.num_experts + local  # [T*K]
    order = torch.argsort(key, stable=True)  # [T*K]
    # not bincount: on a GPU it synchronises twice to size its output
    counts = torch.zeros(placement.num_ranks * placement.num_experts, dtype=torch.int64,
                         device=device).index_add_(0, key, torch.ones_like(key))
    per_rank = counts.view(placement.num_ranks, placement.num_experts).tolist()
    return Layout(
        src_token=token[order],
        weights=topk_weights.reshape(-1)[order],
        rank_counts=[sum(c) for c in per_rank],
        expert_counts=[c[:n] for c, n in zip(per_rank, table.num_local, strict=True)],
        num_tokens=num_tokens,
    )


def combine(y: torch.Tensor, layout: Layout) -> torch.Tensor:
    """out [T, H] = sum over each token's rows of weight * y, for y [N, H] in send order,
    in y's dtype: summed in float32 and rounded once (as DeepEP's combine), not K times."""
    return weighted_sum(y, layout.src_token, layout.weights, layout.num_tokens)


def weighted_sum(y: torch.Tensor, src_token: torch.Tensor, weights: torch.Tensor,
                 num_tokens: int) -> torch.Tensor:
    """out [T, H] with out[src_token[i]] += weights[i] * y[i] for y [N, H], accumulated in
    float32 (in bf16, each of a token's K additions would round) and cast to y's dtype."""
    out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
    out.index_add_(0, src_token, y.float() * weights.float()[:, None])
    return out.to(y.dtype)
