"""Grouped SwiGLU expert FFN over tokens already sorted by expert: float (bf16/float32) and
W4A4 MXFP4, torch paths for any device."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from moe_kernels.mxfp4 import MXFP4Tensor, dequantize, quantize


def swiglu_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x [N, H], w_gate_up [2I, H], w_down [H, I] -> [N, H]."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


def grouped_swiglu(
    x: torch.Tensor, tokens_per_expert: list[int], w_gate_up: torch.Tensor, w_down: torch.Tensor,
    spans: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """Run each local expert's FFN on its contiguous run of rows.

    Args:
        x: [N, H] activations, rows grouped by local expert in expert order.
        tokens_per_expert: E_local ints summing to N; run e belongs to local expert e.
        w_gate_up: [E_local, 2 * I, H] gate and up projections stacked (gate first).
        w_down: [E_local, H, I] down projections.

        spans: if given, filled with each local expert's (start, end) wall-clock ns (for
            per-expert tracing; (0, 0) for experts without tokens).

    Returns:
        [N, H] expert outputs, row-aligned with `x`, not yet weighted by the router.
    """
    out = torch.empty_like(x)
    start = 0
    for expert, count in enumerate(tokens_per_expert):
        t0 = time.time_ns()
        if count:
            rows = slice(start, start + count)
            out[rows] = swiglu_mlp(x[rows], w_gate_up[expert], w_down[expert])
            start += count
        if spans is not None:
            spans.append((t0, time.time_ns()) if count else (0, 0))
    return out


def mxfp4_linear(x: MXFP4Tensor, w: MXFP4Tensor) -> torch.Tensor:
    """x [N, K] @ w [M, K]^T -> [N, M] float32, both MXFP4 (blocks along K).

    The torch reference numerics: both sides decoded exactly to float32, then one float32
    matmul (every product of two MXFP4 values is exact in float32; only the summation order
    differs from a kernel's).
    """
    return F.linear(dequantize(x), dequantize(w))


def grouped_swiglu_w4a4(
    x: MXFP4Tensor, tokens_per_expert: list[int], w_gate_up: MXFP4Tensor,
    w_down: MXFP4Tensor, spans: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """W4A4 version of `grouped_swiglu`, the torch path (any device).

    Args:
        x: MXFP4 of [N, H] activations, rows grouped by local expert in expert order.
        tokens_per_expert: E_local ints summing to N.
        w_gate_up: MXFP4 of [E_local, 2 * I, H] (gate first), blocks along H.
        w_down: MXFP4 of [E_local, H, I], blocks along I.

    Returns:
        [N, H] float32 expert outputs. The SwiGLU output between the two GEMMs is
        re-quantized to MXFP4 per row, so both GEMMs are W4A4.
    """
    n, h = x.shape
    out = torch.empty(n, h, device=x.packed.device)
    start = 0
    for expert, count in enumerate(tokens_per_expert):
        t0 = time.time_ns()
        if count:
            rows = slice(start, start + count)
            gate, up = mxfp4_linear(x[rows], w_gate_up[expert]).chunk(2, dim=-1)
            act = quantize(F.silu(gate) * up)  # [count, I] -> MXFP4
            out[rows] = mxfp4_linear(act, w_down[expert])
            start += count
        if spans is not None:
            spans.append((t0, time.time_ns()) if count else (0, 0))
    return out
