"""Weights in the panel layouts that the CPU kernels read, re-ordered once at load. They
are the same weights, not a copy kept beside them.

Float32 (`csrc/f32_cpu.cpp`): a weight w [..., N, K], in torch's linear layout
(y = x @ w^T), is stored as panels [..., N/16, K, 16]. Panel p holds output columns 16p to
16p + 15, k-major. So the kernel streams each panel once as one sequential read and
multiplies it as outer products: one vector of 16 columns per k, broadcast against each row
of x.

MXFP4 (`csrc/w4a4_cpu.cpp`, its VNNI kernel, with K a multiple of 128): codes are
[..., N/4, K/128, 4, 64], holding per quad of 4 blocks the 64 code bytes of 4 columns one
after another. Scales are [..., N/4, K/128, 4, 4], holding per quad its 4 blocks' scale
bytes of the 4 columns, block-major. A register block of 4 columns then reads one
sequential stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_kernels.mxfp4 import MXFP4Tensor

PANEL = 16  # output columns per panel


@dataclass(frozen=True)
class PanelWeights:
    """One float32 weight w [..., N, K] as panels [..., N/16, K, 16] (`panels`). Where N
    is no multiple of 16, its first `columns` are w's and the rest are zeros
    (`to_panels`)."""

    panels: torch.Tensor
    columns: int | None = None  # w's N where the panels were padded

    @property
    def shape(self) -> tuple[int, ...]:
        """w's shape, [..., N, K]."""
        *lead, groups, k, _ = self.panels.shape
        return (*lead, self.columns or groups * PANEL, k)

    def unpack(self) -> torch.Tensor:
        """w [..., N, K], contiguous, for the torch path. A copy is made on every call."""
        w = self.panels.transpose(-2, -1).flatten(-3, -2)
        return (w if self.columns is None else w[..., :self.columns, :]).contiguous()

    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


def to_panels(w: torch.Tensor, pad: bool = False) -> PanelWeights:
    """w [..., N, K] re-ordered as panels [..., N/16, K, 16].

    N must be a multiple of 16, or with `pad` any N, the last panel's extra columns being
    zeros. Padding serves the dense linears: router gates of 8 experts, for one, take the
    kernel too rather than torch's matmul, whose sums differ with the number of rows.
    """
    n = w.shape[-2]
    if n % PANEL and not pad:
        raise ValueError(f"panels need N a multiple of {PANEL}, not {n}")
    if n % PANEL:
        w = torch.cat([w, w.new_zeros(*w.shape[:-2], -n % PANEL, w.shape[-1])], dim=-2)
    return PanelWeights(w.unflatten(-2, (w.shape[-2] // PANEL, PANEL)).transpose(-2, -1)
                        .contiguous(), n if n % PANEL else None)


@dataclass(frozen=True)
class MXFP4Panels:
    """MXFP4 weights [..., N, K] as the W4A4 CPU kernel's panels: codes packed
    [..., N/4, K/128, 4, 64] and scales [..., N/4, K/128, 4, 4], uint8. They are made by
    the kernel module's `w4a4_panels`, through `selection.panels_for_cpu`."""

    packed: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """The weights' shape, [..., N, K]."""
        *lead, panels, quads, _, _ = self.packed.shape
        return (*lead, 4 * panels, 128 * quads)

    def unpack(self) -> MXFP4Tensor:
        """The weights as stored, packed [..., N, K/2] and scales [..., N, K/32], for the
        torch path. A copy is made on every call."""
        *lead, n, k = self.shape
        return MXFP4Tensor(self.packed.transpose(-3, -2).reshape(*lead, n, k // 2),
                           self.scales.movedim(-1, -3).reshape(*lead, n, k // 32))

    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel()


def plain(w: torch.Tensor | PanelWeights) -> torch.Tensor:
    """w as torch's [..., N, K] tensor, whichever layout it is in."""
    return w.unpack() if isinstance(w, PanelWeights) else w


def plain_mxfp4(w: MXFP4Tensor | MXFP4Panels) -> MXFP4Tensor:
    """w as stored, whichever layout it is in."""
    return w.unpack() if isinstance(w, MXFP4Panels) else w
