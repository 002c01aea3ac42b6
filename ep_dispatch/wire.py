"""Tensors to and from their wire form (`switchyard.messages.Tensor`)."""

from __future__ import annotations

import torch

from moe_kernels.mxfp4 import quantize
from switchyard.messages import Tensor

_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64)}


def to_wire(t: torch.Tensor) -> Tensor:
    t = t.detach().contiguous().cpu()
    return Tensor(t.view(torch.uint8).numpy().tobytes(), str(t.dtype).removeprefix("torch."),
                  list(t.shape))


def from_wire(w: Tensor) -> torch.Tensor:
    if w.dtype not in _DTYPES:
        raise ValueError(f"unsupported wire dtype {w.dtype!r}")
    if not w.data:
        return torch.empty(w.shape, dtype=_DTYPES[w.dtype])
    flat = torch.frombuffer(bytearray(w.data), dtype=torch.uint8)
    return flat.view(_DTYPES[w.dtype]).view(w.shape)


def activation_rows(x: torch.Tensor, quantization: str | None) -> torch.Tensor:
    """What dispatch moves for x [T, H]: x itself, or with "w4a4" its MXFP4 per token,
    [T, H/2 + H/32] uint8 (packed E2M1 codes then E8M0 scales: 0.27x the bytes of bf16)."""
    return quantize(x).to_rows() if quantization == "w4a4" else x
