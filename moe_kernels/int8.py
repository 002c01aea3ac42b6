"""Dense weights in 8 bits: one int8 per weight and one float32 scale per output channel,
a row of w [N, K]. The scheme is symmetric: w ≈ q * s with s = max|w_row| / 127 and
q = round(w / s) in [-127, 127]. A row of zeros gets s = 1 and q = 0.

The CPU kernel (`csrc/int8_cpu.cpp`, `linear_i8`) quantizes the activations as they come,
in blocks of 32 along K with a scale each, by the same rule per block, like llama.cpp's
Q8_0. It multiplies them by exact integer products (AVX512-VNNI's `vpdpbusd`, 64 an
instruction). So a decode step's few rows read a quarter of float32's bytes and spend a
quarter of its instructions on them. `reference_linear` is what it computes, in torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_kernels.panels import PANEL

QMAX = 127  # symmetric: -128 is never used, so -q is always representable
BLOCK = 32  # activations' k per scale; the panels' K is padded to a multiple of it
GROUP = 4  # k per integer lane of the panels (`vpdpbusd` sums 4 products)


@dataclass(frozen=True)
class Int8Panels:
    """int8 weights q [..., N, K] as panels [..., N/16, K'/4, 16, 4], with `scales`
    [..., N rounded up to 16] float32, one per output channel.

    K' is K rounded up to 32, with zeros beyond. Per panel of 16 columns and group of 4
    consecutive k, each column's 4 weights lie side by side. Where N is no multiple of 16,
    its first `columns` are the weight's and the rest are zeros, with scale 1. The leading
    dims are MLA's heads, one matrix each.
    """

    panels: torch.Tensor
    scales: torch.Tensor
    k: int  # the weight's K (the panels hold K')
    columns: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape, [..., N, K]."""
        *lead, groups, _, _, _ = self.panels.shape
        return (*lead, self.columns or groups * PANEL, self.k)

    def quantized(self) -> torch.Tensor:
        """q [..., N, K] int8, as the weight was quantized."""
        n = self.shape[-2]
        q = self.panels.transpose(-3, -2).flatten(-2)  # [..., N/16, 16, K']
        return q.flatten(-3, -2)[..., :n, :self.k]

    def dequantize(self) -> torch.Tensor:
        """q * s as float32 [..., N, K], for the torch path and the reference."""
        return self.quantized().float() * self.scales[..., :self.shape[-2], None]

    def nbytes(self) -> int:
        return self.panels.numel() + self.scales.numel() * self.scales.element_size()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheme's rule: w [..., N, K] (float) -> (q [..., N, K] int8, s [..., N]
    float32)."""
    wf = w.float()
    amax = wf.abs().amax(dim=-1)  # [..., N]
    s = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(wf / s[..., None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, s


def int8_panels(w: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> Int8Panels:
    """w [..., N, K] quantized (`quantize_int8`), or already quantized as (q, s) by a
    checkpoint, laid out for `linear_i8`."""
    q, s = w if isinstance(w, tuple) else quantize_int8(w)
    n, k = q.shape[-2:]
    q = F.pad(q, (0, -k % BLOCK, 0, -n % PANEL))  # [..., N', K']
    s = torch.cat([s, s.new_ones(*s.shape[:-1], -n % PANEL)], dim=-1)
    panels = q.unflatten(-2, (-1, PANEL)).unflatten(-1, (-1, GROUP))  # [.., N/16, 16, K'/4, 4]
    return Int8Panels(panels.transpose(-3, -2).contiguous(), s.float().contiguous(), k,
                      n if n % PANEL else None)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activations: x [..., K] in blocks of 32 along K, K padded with zeros,
    -> (q [..., K'] int8, s [..., K'/32] float32). Each block follows `quantize_int8`'s
    rule."""
    k = x.shape[-1]
    blocks = F.pad(x.float(), (0, -k % BLOCK)).unflatten(-1, (-1, BLOCK))  # [..., K'/32, 32]
    q, s = quantize_int8(blocks)
    return q.flatten(-2), s


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the kernel multiplies it: quantized in blocks and back, float32."""
    q, s = quantize_activations(x)
    return (q.float().unflatten(-1, (-1, BLOCK)) * s[..., None]).flatten(-2)[..., :x.shape[-1]]


def reference_linear(x: torch.Tensor, w: Int8Panels) -> torch.Tensor:
    """What `linear_i8` computes, in torch: x [M, K] quantized in blocks, times the
    dequantized weights [N, K] -> [M, N] float32. The sums are the same up to rounding."""
    return F.linear(dequantized_activations(x), w.dequantize())
