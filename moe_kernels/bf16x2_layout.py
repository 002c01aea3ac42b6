"""MXFP4 weights rearranged for the W4A4 kernel's "bf16x2" inner product (Hopper).

On an H100/H200 the W4A4 GEMM at decode is bound by the instructions that turn 4-bit codes
into MMA operands, not by memory (docs/benchmarks.md). This layout puts each code's four
bits where a few 32-bit operations turn a word of 8 codes into 4 registers of two bfloat16
values each, already scaled, in the order the MMA wants them:

- Rows, blocks and scales stay where `MXFP4Tensor` keeps them: only the 16 bytes of each
  32-block (one row, one scale) are rearranged, so the kernel addresses both layouts alike.
- Word c (bytes 4c..4c+3) of a block holds the block's codes k = 2c + 8j + t for j in 0..3
  and t in 0..1: the values a thread of an MMA quad needs, two of each of its four
  registers (bfloat16 pairs, k and k + 1).
- Code (j, t)'s bit i (0: mantissa, 1-2: exponent, 3: sign) sits where rotating the word
  right by `ROTATIONS[j][i]` and masking with `MASK` leaves it in register j's half t as
  bfloat16's bit 6, 7, 8 or 15: that is the code's value times 2**-126, subnormals included.
  Multiplying by the block's scale times 2**126 (one bfloat16x2 multiply per register:
  `fma.rn.bf16x2` with -0 added, which sm_80 has and sm_90 compiles to HMUL2) makes it
  the exact value. The decode is then 13 operations per 8 values. No arrangement gives
  all four registers one rotation and one mask (an exhaustive search: the bits a register
  needs, 4 per code, cannot tile 32 bits by rotations alone); here three get one of each
  and the fourth two.

The scale times 2**126 is a bfloat16 only for scales up to 2**1, i.e. weights below 16 in
magnitude (and no NaN blocks): `to_bf16x2` refuses others, and their experts run another
variant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_kernels.mxfp4 import BLOCK, SCALE_BIAS, MXFP4Tensor

# bfloat16 bits of a code's mantissa, exponent and sign bits in a register's low half
BF16_BITS = (6, 7, 8, 15)
MASK = 0x81C081C0  # those bits in both halves
# Right rotation per register j and code bit i that brings the bit to its place.
ROTATIONS = ((0, 0, 0, 0), (4, 4, 4, 4), (10, 10, 10, 10), (14, 6, 6, 6))
MAX_SCALE = SCALE_BIAS + 1  # E8M0 byte of 2**1: 2**126 times it is bfloat16's largest power


def _bit_positions() -> list[tuple[int, int, int, int]]:
    """(code in block, code bit, word, bit in word) for the 32 codes of a block."""
    out = []
    for c in range(4):
        for j in range(4):
            for t in range(2):
                for i in range(4):
                    target = 16 * t + BF16_BITS[i]
                    out.append((2 * c + 8 * j + t, i, c, (target + ROTATIONS[j][i]) % 32))
    assert len({(c, bit) for _, _, c, bit in out}) == 128, "bits collide"
    return out


POSITIONS = _bit_positions()


@dataclass(frozen=True)
class Bf16x2Weights:
    """MXFP4 weights `[..., M, K]` in the bf16x2 layout (module docstring).

    packed: [..., M, K / 2] uint8, each 32-block's codes rearranged; scales: [..., M, K / 32]
    uint8 E8M0 bytes, as `MXFP4Tensor`'s, every one at most `MAX_SCALE`.
    """

    packed: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    def __getitem__(self, index: object) -> Bf16x2Weights:
        """Experts or rows (any indexing of the leading dimensions)."""
        return Bf16x2Weights(self.packed[index], self.scales[index])  # type: ignore[index]


def to_bf16x2(w: MXFP4Tensor, chunk_bytes: int = 1 << 24) -> Bf16x2Weights:
    """w in the bf16x2 layout (a copy, on w's device; one host synchronisation), converted
    `chunk_bytes` of codes at a time (the bit shuffling holds 8 bytes per code).

    Raises:
        ValueError: a scale above 2**1 or a NaN block, which the layout cannot scale.
    """
    if w.scales.numel() and int(w.scales.max()) > MAX_SCALE:
        raise ValueError(f"the bf16x2 layout needs every block scale <= 2**1 (weights below "
                         f"16 in magnitude, no NaN); this tensor has scale byte "
                         f"{int(w.scales.max())}")
    half = w.packed.shape[-1]
    rows = w.packed.reshape(-1, half)  # [R, K/2]
    out = torch.empty_like(rows, memory_format=torch.contiguous_format)  # [R, K/2]
    step = max(1, chunk_bytes // max(half, 1))
    for i in range(0, rows.shape[0], step):
        out[i:i + step] = _rearrange(rows[i:i + step])
    return Bf16x2Weights(out.reshape(w.packed.shape), w.scales.clone())


def _rearrange(rows: torch.Tensor) -> torch.Tensor:
    """[R, K/2] packed MXFP4 codes -> the same in the bf16x2 layout."""
    r, half = rows.shape
    codes = torch.stack([rows & 0xF, rows >> 4], dim=-1).reshape(r, half // 16, BLOCK).int()
    words = torch.zeros(r, half // 16, 4, dtype=torch.int64, device=rows.device)
    for k, i, c, bit in POSITIONS:  # [R, K/32, word]
        words[..., c] |= ((codes[..., k] >> i) & 1).long() << bit
    packed = torch.stack([(words >> (8 * b)) & 0xFF for b in range(4)], dim=-1)  # little end
    return packed.to(torch.uint8).reshape(r, half)


def from_bf16x2(w: Bf16x2Weights) -> MXFP4Tensor:
    """The inverse of `to_bf16x2`."""
    *lead, half = w.packed.shape
    b = w.packed.reshape(*lead, half // 16, 4, 4).long()  # [..., K/32, word, byte]
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    codes = torch.zeros(*lead, half // 16, BLOCK, dtype=torch.int64, device=w.packed.device)
    for k, i, c, bit in POSITIONS:
        codes[..., k] |= ((words[..., c] >> bit) & 1) << i
    pairs = codes.reshape(*lead, half, 2)
    return MXFP4Tensor((pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8),
                       w.scales.clone())
