"""Dense weights in 8 bits: one int8 per weight and one float32 scale per output channel
(row of w [N, K]), symmetric: w ≈ q * s with s = max|w_row| / 127 and q = round(w / s) in
[-127, 127] (a row of zeros gets s = 1 and q = 0). The CPU kernel (`csrc/f32_cpu.cpp`,
`linear_i8`) keeps the activations in float32 and widens each weight to float32 in
registers as it is read, so a decode step's few rows read a quarter of float32's bytes;
each output is the float32 sum over k of x * q, times s once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_kernels.panels import PANEL

QMAX = 127  # symmetric: -128 is never used, so -q is always representable


@dataclass(frozen=True)
class Int8Panels:
    """int8 weights q [..., N, K] as panels [..., N/16, K, 16] (`moe_kernels.panels`'
    layout), with `scales` [..., N rounded up to 16] float32, one per output channel;
    where N is no multiple of 16 its first `columns` are the weight's and the rest zeros
    (scale 1). The leading dims are MLA's heads, one matrix each."""

    panels: torch.Tensor
    scales: torch.Tensor
    columns: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape, [..., N, K]."""
        *lead, groups, k, _ = self.panels.shape
        return (*lead, self.columns or groups * PANEL, k)

    def dequantize(self) -> torch.Tensor:
        """q * s as float32 [..., N, K] (the torch path and the reference)."""
        n = self.shape[-2]
        q = self.panels.transpose(-2, -1).flatten(-3, -2)[..., :n, :]  # [..., N, K]
        return q.float() * self.scales[..., :n, None]

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
    """w [..., N, K] quantized (`quantize_int8`), or already quantized as (q, s) (a
    checkpoint's), laid out for `linear_i8`."""
    q, s = w if isinstance(w, tuple) else quantize_int8(w)
    n, k = q.shape[-2:]
    pad = -n % PANEL
    if pad:
        q = torch.cat([q, q.new_zeros(*q.shape[:-2], pad, k)], dim=-2)
        s = torch.cat([s, s.new_ones(*s.shape[:-1], pad)], dim=-1)
    panels = q.unflatten(-2, (q.shape[-2] // PANEL, PANEL)).transpose(-2, -1).contiguous()
    return Int8Panels(panels, s.float().contiguous(), n if pad else None)
