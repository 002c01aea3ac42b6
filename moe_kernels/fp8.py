"""The 8-bit dense scheme on a GPU: FP8 (E4M3) weights with one float32 scale per output
channel. They are multiplied by `torch._scaled_mm` against activations quantized to FP8 per
row as they come, as DeepSeek deploys its dense layers. DeepSeek uses 128 x 128 blocks;
here the scale is per channel, the same granularity as the scheme's CPU form,
`moe_kernels.int8`.

`torch._scaled_mm` takes a [M, K] row-major and b [K, N] column-major, which is a weight
[N, K] transposed, with K and N multiples of 16, and rowwise scales a [M, 1] and b [1, N]. Weights
whose K is no multiple of 16 stay in the model's dtype (`fp8_weights` says which); N is
padded at load.

`benchmarks/gpu_check.py` checks it where a GPU is lent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
ALIGN = 16  # `torch._scaled_mm`'s K and N


@dataclass(frozen=True)
class Fp8Weights:
    """w ≈ weight * scales[:, None]. `weight` is [N', K] float8_e4m3fn, where N' is N
    rounded up to 16 and the extra rows are zeros. `scales` is [1, N'] float32. `columns`
    is N where it was padded."""

    weight: torch.Tensor
    scales: torch.Tensor
    columns: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.weight.shape
        return self.columns or n, k

    def dequantize(self) -> torch.Tensor:
        """weight * scales as float32 [N, K], the reference."""
        n = self.shape[0]
        return (self.weight.float() * self.scales.t())[:n]

    def nbytes(self) -> int:
        return self.weight.numel() + self.scales.numel() * 4


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (q [R, K] float8_e4m3fn, s [R, 1] float32), with q * s ≈ x. Each row's
    largest magnitude goes to FP8's largest; a row of zeros gets s = 1."""
    amax = x.detach().float().abs().amax(dim=-1, keepdim=True)  # [R, 1]
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def fp8_weights(w: torch.Tensor) -> Fp8Weights | None:
    """w [N, K] in FP8 with per-channel scales, or None where `torch._scaled_mm` cannot
    take it because K is no multiple of 16. The caller then keeps it as it is."""
    n, k = w.shape
    if k % ALIGN:
        return None
    pad = -n % ALIGN
    w = torch.cat([w, w.new_zeros(pad, k)]) if pad else w
    q, s = quantize_rows(w)
    return Fp8Weights(q, s.t().contiguous(), n if pad else None)


def fp8_linear(x: torch.Tensor, w: Fp8Weights) -> torch.Tensor:
    """x [M, K] @ w^T -> [M, N] in x's dtype, by one `torch._scaled_mm` with x quantized
    per row to FP8. On a GPU with FP8 (sm89+) that runs on FP8 tensor cores; on the CPU it
    is torch's reference, for the tests."""
    if x.shape[-1] != w.weight.shape[1]:
        raise ValueError(f"x has K = {x.shape[-1]}, the FP8 weight [N, K] has K = "
                         f"{w.weight.shape[1]}")
    lead = x.shape[:-1]
    q, s = quantize_rows(x.reshape(-1, x.shape[-1]))
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) \
        else torch.float32
    if q.shape[0] == 0:
        y = x.new_zeros(0, w.weight.shape[0], dtype=out_dtype)
    else:
        y = torch._scaled_mm(q, w.weight.t(), scale_a=s, scale_b=w.scales,
                             out_dtype=out_dtype)  # [M, N']
    y = y if w.columns is None else y[:, :w.columns]
    return y.reshape(*lead, y.shape[-1])


def reference_linear(x: torch.Tensor, w: Fp8Weights) -> torch.Tensor:
    """What `fp8_linear` computes, in float32 from the dequantized operands."""
    q, s = quantize_rows(x)
    return F.linear(q.float() * s, w.dequantize())
