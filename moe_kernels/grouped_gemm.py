"""Grouped SwiGLU expert FFN over tokens already sorted by expert (torch path, any device)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x [N, H], w_gate_up [2I, H], w_down [H, I] -> [N, H]."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def grouped_swiglu(
    x: torch.Tensor, tokens_per_expert: list[int], w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """Run each local expert's FFN on its contiguous run of rows.

    Args:
        x: [N, H] activations, rows grouped by local expert in expert order.
        tokens_per_expert: E_local ints summing to N; run e belongs to local expert e.
        w_gate_up: [E_local, 2 * I, H] gate and up projections stacked (gate first).
        w_down: [E_local, H, I] down projections.

    Returns:
        [N, H] expert outputs, row-aligned with `x`, not yet weighted by the router.
    """
    out = torch.empty_like(x)
    start = 0
    for expert, count in enumerate(tokens_per_expert):
        if count:
            rows = slice(start, start + count)
            out[rows] = swiglu_mlp(x[rows], w_gate_up[expert], w_down[expert])
            start += count
    return out
