"""MXFP4 per the OCP Microscaling Formats (MX) specification v1.0, in torch (any device).

A block of 32 consecutive values along the last (reduction) dimension shares one E8M0
scale `2**X`; each value is an FP4 E2M1 element `P`, so `v ~ P * 2**X`.

- E2M1 codes: bit 3 is the sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
- Shared exponent: `X = floor(log2(amax)) - 2` (2 is E2M1's largest exponent), clamped to
  the E8M0 range [-127, 127]; stored biased by 127 in one byte.
- Elements: `v / 2**X` rounded to the nearest E2M1 value, ties to even (the code with
  bit 0 clear), saturating at +-6.
- Packing: two elements per byte, the first in the low nibble.

Defined edge cases (the spec leaves some to the implementation):
- a block of zeros gets the smallest scale (byte 0, `2**-127`) and zero elements;
- the sign of zero is kept: -0.0, and negative values that round to zero, encode as 0x8
  and decode as -0.0;
- float32 denormal inputs are exact inputs like any other; with the scale clamped at
  `2**-127`, magnitudes below `2**-129` (a quarter of the smallest scale) become zero;
- a block containing NaN or +-inf gets the NaN scale (byte 0xFF, the spec's NaN) and
  decodes to NaN throughout, since E2M1 has no encoding for either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Self

import torch

BLOCK = 32
E2M1_MAX_EXP = 2
SCALE_BIAS = 127
SCALE_NAN = 0xFF
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding boundaries between consecutive magnitudes; `>=` at a tie rounds up to the even
# code, `>` rounds down to it (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, ...).
_UP_AT_TIE = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
              (3.5, True), (5.0, False))


@dataclass(frozen=True)
class ScaledBlocks:
    """4-bit codes of a [..., K] tensor in blocks of 32 along K, one E8M0 scale each: what
    `MXFP4Tensor` and its kernel layouts (`bf16x2_layout.Bf16x2Weights`) have in common.

    packed: [..., K / 2] uint8, two codes per byte. scales: [..., K / 32] uint8.
    """

    packed: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    def __getitem__(self, index: object) -> Self:
        """Rows, by any indexing of the leading dimensions, in the same layout."""
        return type(self)(self.packed[index], self.scales[index])  # type: ignore[index]

    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel()


@dataclass(frozen=True)
class MXFP4Tensor(ScaledBlocks):
    """Packed MXFP4 values of a [..., K] tensor.

    packed: [..., K / 2] uint8, two E2M1 codes per byte (first value in the low nibble).
    scales: [..., K / 32] uint8, E8M0 biased exponents (0xFF = NaN).
    """

    def split(self, sizes: list[int]) -> list[MXFP4Tensor]:
        """Split along the first dimension, like `torch.Tensor.split`."""
        return [MXFP4Tensor(p, s) for p, s in zip(self.packed.split(sizes),
                                                   self.scales.split(sizes), strict=True)]

    def to_rows(self) -> torch.Tensor:
        """One uint8 row per leading index: [N, K / 2 + K / 32], packed then scales. This
        is how quantized activations travel between processes."""
        return torch.cat([self.packed.reshape(-1, self.packed.shape[-1]),
                          self.scales.reshape(-1, self.scales.shape[-1])], dim=1)

    @staticmethod
    def from_rows(rows: torch.Tensor, k: int) -> MXFP4Tensor:
        """Inverse of `to_rows` for rows of a [N, k] tensor."""
        return MXFP4Tensor(rows[:, :k // 2], rows[:, k // 2:])

    @staticmethod
    def cat(parts: list[MXFP4Tensor]) -> MXFP4Tensor:
        return MXFP4Tensor(torch.cat([p.packed for p in parts]),
                           torch.cat([p.scales for p in parts]))


def check_blockable(k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs the reduction dimension to be a multiple of {BLOCK}; "
                         f"got {k}")


def quantize(x: torch.Tensor) -> MXFP4Tensor:
    """MXFP4 of x [..., K] along its last dimension (K a multiple of 32)."""
    *lead, k = x.shape
    check_blockable(k)
    blocks = x.float().reshape(*lead, k // BLOCK, BLOCK)  # [..., K/32, 32]
    amax = blocks.abs().amax(dim=-1)  # [..., K/32]
    special = ~amax.isfinite()  # NaN or inf somewhere in the block
    # frexp: amax = m * 2**e with m in [0.5, 1), so floor(log2(amax)) = e - 1, exactly,
    # denormals included; a zero block gets the smallest scale.
    _, e = torch.frexp(torch.where(special | (amax == 0), torch.ones_like(amax), amax))
    exp = torch.where(amax == 0, -SCALE_BIAS, e - 1 - E2M1_MAX_EXP).clamp(-SCALE_BIAS,
                                                                         SCALE_BIAS)
    scaled = blocks * torch.exp2(-exp.float())[..., None]  # exact: a power-of-two scaling
    mag = scaled.abs()
    codes = torch.zeros_like(mag, dtype=torch.uint8)
    for boundary, up_at_tie in _UP_AT_TIE:
        codes += (mag >= boundary if up_at_tie else mag > boundary).to(torch.uint8)
    codes |= scaled.signbit().to(torch.uint8) << 3
    codes = torch.where(special[..., None], torch.zeros_like(codes), codes)
    scales = torch.where(special, SCALE_NAN, exp + SCALE_BIAS).to(torch.uint8)
    codes = codes.reshape(*lead, k // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return MXFP4Tensor(packed.contiguous(), scales.contiguous())


def _byte_table() -> torch.Tensor:
    """[256, 2] float32: the two values (low nibble, high nibble) each byte encodes."""
    mags = torch.tensor(E2M1_VALUES)
    codes = torch.cat([mags, -mags])  # [16], by 4-bit code
    return torch.stack([codes.repeat(16), codes.repeat_interleave(16)], dim=1)


def _scale_table() -> torch.Tensor:
    """[256] float32: the scale each E8M0 byte encodes (0xFF: NaN)."""
    scales = torch.exp2(torch.arange(256, dtype=torch.float32) - SCALE_BIAS)
    scales[SCALE_NAN] = float("nan")
    return scales


_BYTES, _SCALES = _byte_table(), _scale_table()


def dequantize(q: MXFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values [..., K] that q encodes, exactly (every MXFP4 value is a float32)."""
    device = q.packed.device
    values = _BYTES.to(device)[q.packed.int()]  # [..., K/2, 2]: one lookup per byte
    *lead, half, _ = values.shape
    k = 2 * half
    scale = _SCALES.to(device)[q.scales.int()]  # [..., K/32]
    out = values.view(*lead, k // BLOCK, BLOCK) * scale[..., None]
    return out.view(*lead, k).to(dtype)
