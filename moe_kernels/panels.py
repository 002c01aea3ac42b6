"""Float32 weights in the panel layout that the CPU kernels read (`csrc/f32_cpu.cpp`).

A weight w [..., N, K] (torch's linear layout: y = x @ w^T) is stored as panels
[..., N/16, K, 16]: panel p holds output columns 16p to 16p + 15, k-major, so the kernel
streams each panel once as one sequential read and multiplies it as outer products (one
vector of 16 columns per k, broadcast against each row of x). It is the same weight
re-ordered once at load, not a copy kept beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL = 16  # output columns per panel


@dataclass(frozen=True)
class PanelWeights:
    """One float32 weight w [..., N, K] as panels [..., N/16, K, 16] (`panels`)."""

    panels: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        """w's shape, [..., N, K]."""
        *lead, groups, k, _ = self.panels.shape
        return (*lead, groups * PANEL, k)

    def unpack(self) -> torch.Tensor:
        """w [..., N, K], contiguous: for the torch path (a copy made on every call)."""
        return self.panels.transpose(-2, -1).flatten(-3, -2).contiguous()

    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


def to_panels(w: torch.Tensor) -> PanelWeights:
    """w [..., N, K] (N a multiple of 16) re-ordered as panels [..., N/16, K, 16]."""
    if w.shape[-2] % PANEL:
        raise ValueError(f"panels need N a multiple of {PANEL}, not {w.shape[-2]}")
    return PanelWeights(w.unflatten(-2, (w.shape[-2] // PANEL, PANEL)).transpose(-2, -1)
                        .contiguous())


def plain(w: torch.Tensor | PanelWeights) -> torch.Tensor:
    """w as torch's [..., N, K] tensor, whichever layout it is in."""
    return w.unpack() if isinstance(w, PanelWeights) else w
