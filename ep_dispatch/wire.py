"""Tensors to and from their wire form (`common.messages.Tensor`).

With w4a4 experts, the attention side quantizes each token's activations before dispatch
(`activation_rows`). A routed row then travels as `H/2 + H/32` bytes, which the expert
service feeds straight into the W4A4 grouped SwiGLU. Such rows travel as they are with the
`local`, `rpc`, `torch` and `nccl` backends. The collectives move `[T, H/2 + H/32]` uint8 rows and
bring float outputs back (`RowFormat`). `rpc` sends tensors as raw bytes with their dtype
and shape, copied to the host once for the wire.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from common.messages import Tensor
from moe_kernels.selection import quantize_fused

_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64)}


def to_wire(t: torch.Tensor) -> Tensor:
    """Any tensor of a wire dtype (float32, bfloat16, float16, uint8, int64), any shape,
    on any device -> its raw bytes in host order, dtype name and shape."""
    return Tensor(tensor_bytes(t), str(t.dtype).removeprefix("torch."), list(t.shape))


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A copy of t's elements as bytes, in host order, from any device.

    It reads memory directly. `Tensor.numpy()` needs numpy, which neither torch nor this
    project depends on. A storage's own `bytes()` goes element by element, 10^5 times
    slower.
    """
    t = t.detach().contiguous().cpu()
    return ctypes.string_at(t.data_ptr(), t.nbytes) if t.numel() else b""


def from_wire(w: Tensor) -> torch.Tensor:
    """The CPU tensor `to_wire` described, as a copy of the frame's bytes. Raises a
    ValueError for a dtype that is not a wire dtype."""
    if w.dtype not in _DTYPES:
        raise ValueError(f"unsupported wire dtype {w.dtype!r}")
    if not w.data:
        return torch.empty(w.shape, dtype=_DTYPES[w.dtype])
    flat = torch.frombuffer(bytearray(w.data), dtype=torch.uint8)
    return flat.view(_DTYPES[w.dtype]).view(w.shape)


def activation_rows(x: torch.Tensor, quantization: str | None) -> torch.Tensor:
    """What dispatch moves for x [T, H]: x itself, or with "w4a4" its MXFP4 per token.
    That is [T, H/2 + H/32] uint8, the packed E2M1 codes then the E8M0 scales, 0.27x the
    bytes of bf16."""
    return quantize_fused(x).to_rows() if quantization == "w4a4" else x


@dataclass(frozen=True)
class RowFormat:
    """What the lockstep backends move per routed token: rows out, expert outputs back.

    hidden: H.
    dtype: the activations' and the expert outputs' dtype.
    quantization: "w4a4" sends each row as its MXFP4 bytes, `[H/2 + H/32]` uint8
        (`activation_rows`). Outputs come back as `[H]` in `dtype` either way.
    """

    hidden: int
    dtype: torch.dtype
    quantization: str | None = None

    @property
    def width(self) -> int:
        """Columns of one dispatched row."""
        return self.hidden // 2 + self.hidden // 32 if self.quantization else self.hidden

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] in `dtype` -> the rows that travel, [T, width]."""
        return activation_rows(x, self.quantization)

    def empty_rows(self, n: int, device: torch.device) -> torch.Tensor:
        """[n, width] in the rows' dtype, uint8 for MXFP4."""
        dtype = torch.uint8 if self.quantization else self.dtype
        return torch.empty(n, self.width, dtype=dtype, device=device)

    def empty_outputs(self, n: int, device: torch.device) -> torch.Tensor:
        """[n, H] in `dtype`."""
        return torch.empty(n, self.hidden, dtype=self.dtype, device=device)

    def describe(self) -> str:
        """e.g. "MXFP4 rows of hidden 7168 (4032 bytes), bfloat16 outputs"."""
        dtype = str(self.dtype).removeprefix("torch.")
        if self.quantization:
            return f"MXFP4 rows of hidden {self.hidden} ({self.width} bytes), {dtype} outputs"
        return f"{dtype} rows of hidden {self.hidden}"
