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
  Multiplying by the block's scale times 2**126 makes it the exact value. That is one
  bfloat16x2 multiply per register, `fma.rn.bf16x2` with -0 added, which sm_80 has and
  sm_90 compiles to HMUL2. The decode is then 13 operations per 8 values. No arrangement
  gives all four registers one rotation and one mask: an exhaustive search showed that the
  bits a register needs, 4 per code, cannot tile 32 bits by rotations alone. Here three
  registers get one of each, and the fourth two.

The scale times 2**126 is a bfloat16 only for scales up to 2**1, that is, for weights below
16 in magnitude, and only without NaN blocks. `to_bf16x2` refuses other weights, and their
experts run another variant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_kernels.mxfp4 import SCALE_BIAS, MXFP4Tensor, ScaledBlocks

# bfloat16 bits of a code's mantissa, exponent and sign bits in a register's low half
BF16_BITS = (6, 7, 8, 15)
MASK = 0x81C081C0  # those bits in both halves
# Right rotation per register j and code bit i that brings the bit to its place.
ROTATIONS = ((0, 0, 0, 0), (4, 4, 4, 4), (10, 10, 10, 10), (14, 6, 6, 6))
MAX_SCALE = SCALE_BIAS + 1  # E8M0 byte of 2**1: 2**126 times it is bfloat16's largest power
# A block's scale byte s as the multiplier pair the decode takes: bfloat16 2**(s - 1), i.e.
# the scale times 2**126, in both halves (exponent field s + 126).
PAIR_STEP, PAIR_BASE = 0x00800080, 0x3F003F00  # pair = s * PAIR_STEP + PAIR_BASE

# The decode of one word ($8) with its block's pair ($9), for `tl.inline_asm_elementwise`
# with pack 1. Register j is (word rotated right by ROTATIONS[j]) & MASK; register 3 takes
# two rotations, masked apart. It is multiplied by the pair with -0 added, so zeros keep
# their sign, giving bfloat16 halves $2j (low) and $2j + 1 (high). 13 instructions per
# word, sm_80 and later.
# tests/support/ptx.py runs this text on the CPU.
PTX = """{
        .reg .b32 r, s, z;
        mov.b32 z, 0x80008000;
        and.b32 r, $8, 0x81C081C0;
        fma.rn.bf16x2 r, r, $9, z;
        mov.b32 {$0, $1}, r;
        shf.r.wrap.b32 r, $8, $8, 4;
        and.b32 r, r, 0x81C081C0;
        fma.rn.bf16x2 r, r, $9, z;
        mov.b32 {$2, $3}, r;
        shf.r.wrap.b32 r, $8, $8, 10;
        and.b32 r, r, 0x81C081C0;
        fma.rn.bf16x2 r, r, $9, z;
        mov.b32 {$4, $5}, r;
        shf.r.wrap.b32 r, $8, $8, 14;
        and.b32 r, r, 0x00400040;
        shf.r.wrap.b32 s, $8, $8, 6;
        and.b32 s, s, 0x81808180;
        or.b32 r, r, s;
        fma.rn.bf16x2 r, r, $9, z;
        mov.b32 {$6, $7}, r;
        }"""
PTX_CONSTRAINTS = "=h,=h,=h,=h,=h,=h,=h,=h,r,r"  # 8 bfloat16 out; the word and the pair in


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


def _block_permutation() -> torch.Tensor:
    """The layout as a permutation of a block's 128 bits: [128] int64, block bit 32c + p
    (word c, its bit p, little endian) is code bit 4k + i (code k of the block in K order,
    its bit i)."""
    source = torch.empty(128, dtype=torch.long)
    for k, i, c, bit in _bit_positions():
        source[32 * c + bit] = 4 * k + i
    return source


FROM_CODE_BIT = _block_permutation()
TO_CODE_BIT = torch.argsort(FROM_CODE_BIT)  # the inverse permutation


@dataclass(frozen=True)
class Bf16x2Weights(ScaledBlocks):
    """MXFP4 weights `[..., M, K]` in the bf16x2 layout the module docstring describes. It
    is not an `MXFP4Tensor`, so that nothing decodes it as one.

    packed: [..., M, K / 2] uint8, each 32-block's codes rearranged; scales: [..., M, K / 32]
    uint8 E8M0 bytes, as `MXFP4Tensor`'s, every one at most `MAX_SCALE`.
    """


def to_bf16x2(w: MXFP4Tensor, chunk_bytes: int = 1 << 22) -> Bf16x2Weights:
    """w in the bf16x2 layout, as a copy on w's device, with one host synchronisation. It
    converts `chunk_bytes` of codes at a time, as the bit permutation holds 32 bytes per
    code byte.

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
        out[i:i + step] = _permute_bits(rows[i:i + step], FROM_CODE_BIT)
    return Bf16x2Weights(out.reshape(w.packed.shape), w.scales.clone())


def _permute_bits(rows: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """[R, K/2] uint8 -> the same with each 16-byte block's 128 bits permuted: bit j of a
    block (byte j // 8, its bit j % 8) becomes the input's bit `source[j]`."""
    r, half = rows.shape
    shifts = torch.arange(8, dtype=torch.uint8, device=rows.device)  # [8]
    bits = (rows.reshape(r, half // 16, 16, 1) >> shifts) & 1  # [R, K/32, 16, 8]
    bits = bits.reshape(r, half // 16, 128)[..., source.to(rows.device)]  # [R, K/32, 128]
    weights = (1 << shifts.int()).to(torch.uint8)  # [8]: a byte's bit values
    return (bits.reshape(r, half // 16, 16, 8) * weights).sum(-1, dtype=torch.uint8
                                                              ).reshape(r, half)


def from_bf16x2(w: Bf16x2Weights) -> MXFP4Tensor:
    """The inverse of `to_bf16x2`."""
    half = w.packed.shape[-1]
    rows = w.packed.reshape(-1, half)  # [R, K/2]
    packed = _permute_bits(rows, TO_CODE_BIT) if rows.shape[0] else rows.clone()
    return MXFP4Tensor(packed.reshape(w.packed.shape), w.scales.clone())
