"""Triton grouped GEMM over experts for W4A4 MXFP4: MXFP4 activations x MXFP4 weights with
float32 accumulation, through `tl.dot_scaled(..., "e2m1", ..., "e2m1")`.

This module is the only one in the project that imports triton; import it lazily. On a CPU
the tests run it under `TRITON_INTERPRET=1`, set before this module is imported. The
interpreter implements `tl.dot_scaled` from triton 3.8 on; 3.7.0 and older lack it. The
tests first teach the interpreter what it lacks, as described below.

Numerics match `moe_kernels.grouped_gemm.mxfp4_linear`: every MXFP4 value, and every product
of two, is exact in bfloat16/float32, so only the order of the float32 summation can differ from
the torch path: one K tile at a time here, one matmul there.

Layout recap (see `moe_kernels.mxfp4`): `packed [..., K/2] uint8` holds two E2M1 codes per
byte, the first value in the low nibble, which is the order `tl.dot_scaled` expects for
"e2m1" packed along K. `scales [..., K/32] uint8` holds E8M0 biased exponents, 0xFF meaning
NaN. `tl.dot_scaled` takes its lhs as `[rows, K/2]` with scales `[rows, K/32]`. It takes its
rhs as `[K/2, cols]`, packed along K (`rhs_k_pack=True`), with scales `[cols, K/32]`, not
transposed. So a weight tile loaded as `[cols, K/2]` is passed transposed, and its scales as
loaded.

There are six inner products, selected by `inner`. All are exact; the H200 runs chose the
default (docs/benchmarks.md).
- "dot_scaled" (default): `tl.dot_scaled`, a native block-scaled MMA on Blackwell. On
  Hopper and older, triton decomposes it into an upcast to bfloat16 and an ordinary MMA.
- "decode": an explicit in-kernel decode of codes and scales to float32, then `tl.dot` in
  TF32, which is exact here since MXFP4 values have at most 2 mantissa bits. It is for
  triton builds or targets where `tl.dot_scaled` with e2m1 on both sides fails.
- "bf16": the same decode, then a bfloat16 `tl.dot`.
- "f16": codes as float16 by three integer operations, one MMA per 32-block, and the
  block's product scaled by both scales in float32.
- "f16x2": the same, with the weight codes decoded a 32-bit word at a time, two float16
  codes per word operation. It is for Hopper, where the decode and not the memory bounds
  the kernel.
- "bf16x2": the activations are decoded to bfloat16 values once, ahead of the kernel, not
  once per weight tile. The weights, kept in their own layout (`moe_kernels.bf16x2_layout`),
  are decoded by inline PTX (sm_80 and later) into bfloat16 MMA operands with their scales
  applied, two values per instruction. Then one bfloat16 MMA runs per K step, with no
  per-block scaling of partial sums.
Triton's interpreter runs neither inline PTX nor bfloat16 dots (triton-lang/triton#11584),
and it truncates casts to bfloat16. The tests teach it all three
(tests/support/triton_interpreter.py), so they run every variant as written, the asm text
included; a GPU run checks the hardware.
Either operand can be the MMA's left one (`swap_ab`), and K can be split over programs
(`split_k`).

The grid is E x cdiv(max rows, block_n) tiles when the caller knows its counts, else a tile
schedule built on the device. The activations' quantizer on CUDA is one Triton kernel too
(`quantize_mxfp4`), where the torch one runs 58 tensor operations. It is byte for byte the
same as `mxfp4.quantize` under the interpreter, but has not yet run on a GPU.
`kernel_configs` decides which variant and tiles run.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moe_kernels.bf16x2_layout import (
    PAIR_BASE,
    PAIR_STEP,
    PTX,
    PTX_CONSTRAINTS,
    Bf16x2Weights,
    to_bf16x2,
)
from moe_kernels.grouped_gemm import row_ends
from moe_kernels.kernel_configs import INNER_PRODUCTS, KernelConfig, tuned_config
from moe_kernels.mxfp4 import BLOCK, MXFP4Tensor, ScaledBlocks, check_blockable


@triton.jit
def _e8m0(scales):
    """E8M0 biased exponents (any int shape) -> exact float32 2**(s - 127). Byte 0 is the
    subnormal 2**-127 (0x00400000), and 0xFF is NaN."""
    s = scales.to(tl.int32)
    bits = tl.where(s == 0xFF, 0x7FC00000, tl.where(s == 0, 0x00400000, s << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_mxfp4(packed, scales, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decode one MXFP4 tile to float32, exactly as `moe_kernels.mxfp4.dequantize`.

    packed: [ROWS, BLOCK_K / 2] uint8, two E2M1 codes per byte, first in the low nibble.
    scales: [ROWS, BLOCK_K / 32] uint8, E8M0 biased exponents (0xFF = NaN).
    Returns [ROWS, BLOCK_K] float32.
    """
    codes = tl.join(packed & 0xF, packed >> 4)  # [ROWS, BLOCK_K / 2, 2], low nibble first
    codes = tl.reshape(codes, [ROWS, BLOCK_K]).to(tl.int32)  # [ROWS, BLOCK_K]
    mag = codes & 7
    # E2M1 magnitudes as float32 bits: codes 2..7 are normal, 1.m * 2**(e - 1) with
    # e = mag >> 1 and m = mag & 1 (1, 1.5, 2, 3, 4, 6); code 1 is the subnormal 0.5.
    normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)
    bits = tl.where(mag >= 2, normal, tl.where(mag == 1, 126 << 23, 0))
    values = (bits | ((codes & 8) << 28)).to(tl.float32, bitcast=True)  # sign into bit 31
    scale = _e8m0(scales)  # [ROWS, BLOCK_K / 32]
    values = tl.reshape(values, [ROWS, BLOCK_K // 32, 32]) * scale[:, :, None]
    return tl.reshape(values, [ROWS, BLOCK_K])


_PTX, _PTX_CONSTRAINTS = tl.constexpr(PTX), tl.constexpr(PTX_CONSTRAINTS)
_PAIR_STEP, _PAIR_BASE = tl.constexpr(PAIR_STEP), tl.constexpr(PAIR_BASE)


@triton.jit
def _decode_bf16x2(words, scales, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weights in the bf16x2 layout (`moe_kernels.bf16x2_layout`) to their exact values.

    words: [ROWS, BLOCK_K / 8] uint32, the packed codes read as little-endian words;
    scales: [ROWS, BLOCK_K / 32] uint8 E8M0 bytes, at most 2**1. Returns [ROWS, BLOCK_K]
    bfloat16 in K order, each thread holding the MMA operand registers it decoded.
    """
    # one 32-bit word per asm call (pack 1): which elements a packed call gets is the
    # layout's choice, and the layout Triton picks for the MMA interleaves rows
    scales = tl.reshape(tl.broadcast_to(scales[:, :, None], [ROWS, BLOCK_K // 32, 4]),
                        [ROWS, BLOCK_K // 8]).to(tl.uint32)  # [ROWS, word]
    h = _bf16x2_asm(words, scales * _PAIR_STEP + _PAIR_BASE)  # 8 x [ROWS, word] bfloat16
    # h[2j + t]: register j's half t, code 2c + 8j + t of the block for word c
    regs = tl.join(tl.join(tl.join(h[0], h[1]), tl.join(h[2], h[3])),
                   tl.join(tl.join(h[4], h[5]), tl.join(h[6], h[7])))  # [ROWS, word, t, j0, j1]
    regs = tl.reshape(regs, [ROWS, BLOCK_K // 32, 4, 2, 2, 2])  # [ROWS, block, c, t, j0, j1]
    return tl.reshape(tl.permute(regs, (0, 1, 5, 4, 2, 3)), [ROWS, BLOCK_K])  # k = 8j + 2c + t


@triton.jit
def _bf16x2_asm(words, pair):
    """Per 32-bit word: `bf16x2_layout.PTX`'s 8 bfloat16 tensors, register j's low and high
    halves at 2j and 2j + 1. `pair` is the block's scale times 2**126, as two bfloat16."""
    return tl.inline_asm_elementwise(
        asm=_PTX, constraints=_PTX_CONSTRAINTS, args=[words, pair],
        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def _codes_f16(packed, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """E2M1 codes as float16 equal to value * 2**-14, made by placing the code's exponent
    and mantissa bits in float16's lowest exponent bits; code 1, which is 0.5, becomes the
    subnormal 2**-15. That takes three integer operations per value, with no lookups and
    no scale.

    packed: [ROWS, BLOCK_K / 2] uint8, first value in the low nibble. Returns
    [ROWS, BLOCK_K] float16.
    """
    codes = tl.join(packed & 0xF, packed >> 4)  # [ROWS, BLOCK_K / 2, 2]
    codes = tl.reshape(codes, [ROWS, BLOCK_K]).to(tl.int16)  # [ROWS, BLOCK_K]
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)  # magnitude to bits 11..9, sign to 15
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _words_f16(words, ROWS: tl.constexpr):
    """One 32-block of E2M1 codes as float16 equal to value * 2**-14, as in `_codes_f16`,
    but decoded a 32-bit word (8 codes) at a time.

    Each result word holds two float16 codes, made by two shifts, two masks and an or, then
    split in halves; `_codes_f16` spends about as many operations on each value. A GPU run
    is to measure what the compiler makes of both (benchmarks/gpu_mxfp4.py).

    words: [ROWS, 4] uint32, the block's 16 bytes read as little-endian words (code k of a
    word in bits 4k..4k+3). Returns [ROWS, 32] float16 in K order, as `_codes_f16`.
    """
    # Codes j and j + 4 of each word: magnitudes (bits 4j..4j+2, 16+4j..) shifted to bits
    # 9..11 and 25..27, signs (bits 4j+3, 16+4j+3) to bits 15 and 31.
    h0 = _word_pair_f16(words << 9, words << 12)  # [ROWS, 4, 2]: codes 0 and 4
    h1 = _word_pair_f16(words << 5, words << 8)  # codes 1 and 5
    h2 = _word_pair_f16(words << 1, words << 4)  # codes 2 and 6
    h3 = _word_pair_f16(words >> 3, words)  # codes 3 and 7
    codes = tl.join(tl.join(h0, h1), tl.join(h2, h3))  # [ROWS, word, half, j & 1, j >> 1]
    # code j + 4 * half of word q is element 8q + 4 * half + j: natural K order
    codes = tl.permute(codes, (0, 1, 2, 4, 3))  # [ROWS, word, half, j >> 1, j & 1] int16
    return tl.reshape(codes, [ROWS, 32]).to(tl.float16, bitcast=True)  # [ROWS, 32]


@triton.jit
def _word_pair_f16(mags, signs):
    """[ROWS, 4] uint32 words with two codes' magnitudes in bits 9..11 and 25..27 and their
    signs in bits 15 and 31 -> [ROWS, 4, 2] int16: the two float16 codes' bits."""
    pair = (mags & 0x0E000E00) | (signs & 0x80008000)
    return tl.join(pair.to(tl.int16), (pair >> 16).to(tl.int16))


@triton.jit
def _block_f16(x_rows, xs_rows, w_rows, ws_rows, row_ok, col_ok, blk, K, acc,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, WORDS: tl.constexpr,
               SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr):
    """acc + the product of 32-block `blk` of x's rows and w's rows through float16 codes:
    one float16 MMA of the codes, then both blocks' scales applied to its result.

    x_rows, w_rows: [BLOCK_N, 1] and [BLOCK_M, 1] pointers to the rows' packed codes (uint8);
    xs_rows, ws_rows: the same for their scales. acc: [BLOCK_N, BLOCK_M] float32, or
    [BLOCK_M, BLOCK_N] with SWAP_AB. WORDS: decode 32-bit words (`_words_f16`), else bytes.
    """
    x_ok = row_ok[:, None]  # [BLOCK_N, 1]
    w_ok = col_ok[:, None]  # [BLOCK_M, 1]
    if not EVEN_K:  # a block past K: its codes and scales read as 0, the value +0
        in_k = tl.full([1, 1], blk, tl.int32) < K // 32  # [1, 1]: a tensor, as the
        x_ok = x_ok & in_k  # interpreter's loop counters are Python ints
        w_ok = w_ok & in_k
    xs = tl.load(xs_rows + blk, mask=x_ok, other=0)  # [BLOCK_N, 1] uint8
    ws = tl.load(ws_rows + blk, mask=w_ok, other=0)  # [BLOCK_M, 1] uint8
    byte = (blk * 16 + tl.arange(0, 16))[None, :]  # [1, 16]
    # [BLOCK_N, 32] float16, value * 2**-14: the tokens' few rows by bytes (word decoding
    # them costs more layout shuffles than it saves, per the compiled code)
    x_h = _codes_f16(tl.load(x_rows + byte, mask=x_ok, other=0), BLOCK_N, 32)
    if WORDS:  # the caller checked that rows and their starts are 4-byte aligned
        # Cast the block's start, then step in words: contiguous, so one 16-byte load per
        # row (byte offsets cast after would read 4 separate words).
        word = tl.arange(0, 4)[None, :]  # [1, 4]
        w = tl.load((w_rows + blk * 16).to(tl.pointer_type(tl.uint32)) + word, mask=w_ok,
                    other=0)  # [BLOCK_M, 4] uint32
        w_h = _words_f16(w, BLOCK_M)  # [BLOCK_M, 32] float16, value * 2**-14
    else:
        w_h = _codes_f16(tl.load(w_rows + byte, mask=w_ok, other=0), BLOCK_M, 32)
    # 32 products of two codes, each a multiple of 2**-30 below 36 * 2**-28, add up exactly
    # in float32; then undo the 2**-28 and apply both scales (exact).
    # One return, after the if/else: Triton traces code after a constexpr branch that
    # returns (triton-lang/triton#9719), so an early return would add mismatched shapes.
    if SWAP_AB:
        block = tl.dot(w_h, tl.trans(x_h)) * 268435456.0  # [BLOCK_M, BLOCK_N]
        acc += block * _e8m0(ws) * tl.reshape(_e8m0(xs), [1, BLOCK_N])
    else:
        block = tl.dot(x_h, tl.trans(w_h)) * 268435456.0  # [BLOCK_N, BLOCK_M]
        acc += block * _e8m0(xs) * tl.reshape(_e8m0(ws), [1, BLOCK_M])
    return acc


@triton.jit
def _mma(x, w, acc, SWAP_AB: tl.constexpr):
    """acc + x @ w.T, for [N, K] and [M, K] operands, or its transpose with the weights as
    the MMA's left operand. Float32 operands run in TF32, which is exact for MXFP4 values."""
    if SWAP_AB:
        acc = tl.dot(w, tl.trans(x), acc, input_precision="tf32")
    else:
        acc = tl.dot(x, tl.trans(w), acc, input_precision="tf32")
    return acc


@triton.jit
def _grouped_mxfp4_gemm_kernel(
    x_ptr, x_scale_ptr,  # [N, K/2] uint8, [N, K/32] uint8: activations, rows sorted by expert
    w_ptr, w_scale_ptr,  # [E, M, K/2] uint8, [E, M, K/32] uint8: weights
    out_ptr,  # [N, M] float32
    offsets_ptr,  # [E + 1] int32: expert e owns rows offsets[e]:offsets[e + 1]
    tile_expert_ptr, tile_row_ptr,  # [T] int32 each: the row-tile schedule (unless DENSE)
    M, K, num_experts, tiles_per_expert, k_per_split,
    stride_xn, stride_xsn,  # row strides of x packed / scales (elements; last dims dense)
    stride_we, stride_wm, stride_wse, stride_wsm,  # expert and row strides of w packed / scales
    stride_on, stride_os,  # row stride of out; its split stride (SPLIT_K > 1)
    BLOCK_N: tl.constexpr,  # rows (tokens) per tile
    BLOCK_M: tl.constexpr,  # output features per tile
    BLOCK_K: tl.constexpr,  # reduction elements per step, a multiple of 32
    INNER: tl.constexpr,  # 0: tl.dot_scaled; 1: decode, tf32 tl.dot; 2: decode, bf16 tl.dot;
    # 3: float16 codes, one MMA per 32-block, scales applied to its product; 4: the same,
    # codes decoded a 32-bit word at a time
    SWAP_AB: tl.constexpr,  # weights as the MMA's left operand (tokens as its N)
    DENSE: tl.constexpr,  # tiles_per_expert row tiles per expert instead of the schedule
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks, so loads vectorize
    SPLIT_K: tl.constexpr,  # programs sharing one tile's K, each writing its partial sum
):
    """Program (tile, m-tile): out[rows, cols] = x[rows] @ w[expert, cols].T over all of K,
    where the row tile `tile` lies inside one expert's rows (see `_tile_schedule`)."""
    tile = tl.program_id(0)  # (grid axis 0: up to 2**31 - 1 tiles; axis 1 stops at 65535)
    pid_m = tl.program_id(1)
    if DENSE:
        expert = tile // tiles_per_expert
        row_start = tl.load(offsets_ptr + expert) + (tile % tiles_per_expert) * BLOCK_N
    else:
        expert = tl.load(tile_expert_ptr + tile)
        if expert >= num_experts:  # a grid slot past the last real tile
            return
        row_start = tl.load(tile_row_ptr + tile)
    row_end = tl.load(offsets_ptr + expert + 1)
    if row_start >= row_end:  # DENSE: this expert has fewer row tiles
        return

    rows = row_start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    cols = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < row_end  # [BLOCK_N]: rows of the next expert, or past N, are masked
    col_ok = cols < M  # [BLOCK_M]
    rows64 = rows.to(tl.int64)  # 64-bit offsets: E * M * K / 2 passes 2**31 for big models
    cols64 = cols.to(tl.int64)
    expert64 = expert.to(tl.int64)
    kb = tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2] byte within the K step
    ks = tl.arange(0, BLOCK_K // 32)  # [BLOCK_K / 32] scale block within the K step

    x_rows = x_ptr + rows64[:, None] * stride_xn  # [BLOCK_N, 1]
    xs_rows = x_scale_ptr + rows64[:, None] * stride_xsn  # [BLOCK_N, 1]
    w_rows = w_ptr + expert64 * stride_we + cols64[:, None] * stride_wm  # [BLOCK_M, 1]
    ws_rows = w_scale_ptr + expert64 * stride_wse + cols64[:, None] * stride_wsm  # [BLOCK_M, 1]

    acc = tl.zeros([BLOCK_M, BLOCK_N] if SWAP_AB else [BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_start = tl.program_id(2) * k_per_split if SPLIT_K > 1 else 0
    k_end = tl.minimum(K, k_start + k_per_split) if SPLIT_K > 1 else K
    for k0 in range(k_start, k_end, BLOCK_K):
        if INNER == 3 or INNER == 4:  # float16 codes: one MMA per 32-block, its product scaled
            for s in tl.static_range(BLOCK_K // 32):
                acc = _block_f16(x_rows, xs_rows, w_rows, ws_rows, row_ok, col_ok,
                                 k0 // 32 + s, K, acc, BLOCK_N, BLOCK_M, INNER == 4, SWAP_AB,
                                 EVEN_K)
        else:
            byte = k0 // 2 + kb  # [BLOCK_K / 2]
            blk = k0 // 32 + ks  # [BLOCK_K / 32]
            # K is a multiple of 32, so a partial last step masks whole blocks; masked bytes
            # and scales read as 0, i.e. the value +0 (times 2**-127), adding nothing.
            byte_ok = (byte < K // 2) | EVEN_K  # EVEN_K, a constexpr True: no K masks at all
            blk_ok = (blk < K // 32) | EVEN_K
            if INNER == 5:  # x holds values (bfloat16), w the bf16x2 layout
                ws = tl.load(ws_rows + blk[None, :], mask=col_ok[:, None] & blk_ok[None, :],
                             other=0)  # [BLOCK_M, BLOCK_K / 32] uint8
                k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
                x_v = tl.load(x_rows + k[None, :], other=0.0,
                              mask=row_ok[:, None] & ((k < K) | EVEN_K)[None, :])
                word_k = k0 + 8 * tl.arange(0, BLOCK_K // 8)  # [BLOCK_K / 8]: 8 codes each
                words = tl.load((w_rows + k0 // 2).to(tl.pointer_type(tl.uint32))
                                + tl.arange(0, BLOCK_K // 8)[None, :], other=0,
                                mask=col_ok[:, None] & ((word_k < K) | EVEN_K)[None, :])
                acc = _mma(x_v, _decode_bf16x2(words, ws, BLOCK_M, BLOCK_K), acc, SWAP_AB)
            else:
                x = tl.load(x_rows + byte[None, :], mask=row_ok[:, None] & byte_ok[None, :],
                            other=0)  # [BLOCK_N, BLOCK_K / 2] uint8
                xs = tl.load(xs_rows + blk[None, :], mask=row_ok[:, None] & blk_ok[None, :],
                             other=0)  # [BLOCK_N, BLOCK_K / 32] uint8
                w = tl.load(w_rows + byte[None, :], mask=col_ok[:, None] & byte_ok[None, :],
                            other=0)  # [BLOCK_M, BLOCK_K / 2] uint8
                ws = tl.load(ws_rows + blk[None, :], mask=col_ok[:, None] & blk_ok[None, :],
                             other=0)  # [BLOCK_M, BLOCK_K / 32] uint8
                if INNER == 0:
                    # rhs [BLOCK_K / 2, cols] packed along K; its scales stay [cols, K / 32].
                    if SWAP_AB:
                        acc = tl.dot_scaled(w, ws, "e2m1", tl.trans(x), xs, "e2m1", acc)
                    else:
                        acc = tl.dot_scaled(x, xs, "e2m1", tl.trans(w), ws, "e2m1", acc)
                else:
                    x_f = _decode_mxfp4(x, xs, BLOCK_N, BLOCK_K)  # [BLOCK_N, BLOCK_K] float32
                    w_f = _decode_mxfp4(w, ws, BLOCK_M, BLOCK_K)  # [BLOCK_M, BLOCK_K] float32
                    if INNER == 2:  # exact: MXFP4 values have at most 2 mantissa bits
                        x_f = x_f.to(tl.bfloat16)
                        w_f = w_f.to(tl.bfloat16)
                    acc = _mma(x_f, w_f, acc, SWAP_AB)

    if SWAP_AB:
        acc = tl.trans(acc)  # [BLOCK_N, BLOCK_M]
    if SPLIT_K > 1:
        out_ptr += tl.program_id(2).to(tl.int64) * stride_os
    out = out_ptr + rows64[:, None] * stride_on + cols64[None, :]  # [BLOCK_N, BLOCK_M]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _dequantize_kernel(
    packed_ptr, scales_ptr,  # [R, K/2] uint8, [R, K/32] uint8 (row strides below)
    out_ptr,  # [R, K] in the output dtype, dense
    R, K, stride_p, stride_s,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (row block, K block): decode MXFP4 values, exactly, to out's dtype."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    kb = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2]
    ks = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)  # [BLOCK_K / 32]
    row_ok = rows[:, None] < R
    rows64 = rows.to(tl.int64)[:, None]
    packed = tl.load(packed_ptr + rows64 * stride_p + kb[None, :],
                     mask=row_ok & (kb[None, :] < K // 2), other=0)
    scales = tl.load(scales_ptr + rows64 * stride_s + ks[None, :],
                     mask=row_ok & (ks[None, :] < K // 32), other=0)
    values = _decode_mxfp4(packed, scales, BLOCK_R, BLOCK_K)  # [BLOCK_R, BLOCK_K] float32
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    tl.store(out_ptr + rows64 * K + k[None, :], values.to(out_ptr.dtype.element_ty),
             mask=row_ok & (k[None, :] < K))


@triton.jit
def _quantize_kernel(
    x_ptr,  # [R, K] float (any float dtype), last dim dense
    packed_ptr, scales_ptr,  # [R, K/2] uint8, [R, K/32] uint8, dense
    R, K, stride_x,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (row block, K block): `moe_kernels.mxfp4.quantize`, bit for bit."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    ok = (rows[:, None] < R) & (k[None, :] < K)  # [BLOCK_R, BLOCK_K]: K % 32 == 0
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows64 * stride_x + k[None, :], mask=ok, other=0.0).to(tl.float32)
    v = tl.reshape(x, [BLOCK_R, BLOCK_K // 32, 32])  # [BLOCK_R, blocks, 32]
    special = tl.max(((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32), axis=2) > 0
    amax = tl.max(tl.where(v == v, tl.abs(v), 0.0), axis=2)  # [BLOCK_R, blocks]
    # floor(log2(amax)) - 2 from the exponent field, clamped to E8M0's [-127, 127]: a
    # denormal or zero amax (field 0) lies below 2**-126, so it clamps to -127 too
    field = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exp = tl.maximum(field - 129, -127)  # [BLOCK_R, blocks]
    inverse = ((127 - exp) << 23).to(tl.float32, bitcast=True)  # 2**-exp, exact
    scaled = v * inverse[:, :, None]  # exact: a power-of-two scaling
    mag = tl.abs(scaled)
    # E2M1 rounding, ties to the even code: `moe_kernels.mxfp4._UP_AT_TIE`
    code = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
            + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32)
            + (mag >= 3.5).to(tl.int32) + (mag > 5.0).to(tl.int32))
    code |= ((scaled.to(tl.int32, bitcast=True) >> 31) & 1) << 3  # the sign, -0.0 included
    code = tl.where(special[:, :, None], 0, code)  # [BLOCK_R, blocks, 32]
    lo, hi = tl.split(tl.reshape(code, [BLOCK_R, BLOCK_K // 2, 2]))  # first value low
    kb = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(packed_ptr + rows64 * (K // 2) + kb[None, :], (lo | (hi << 4)).to(tl.uint8),
             mask=(rows[:, None] < R) & (kb[None, :] < K // 2))
    ks = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    tl.store(scales_ptr + rows64 * (K // 32) + ks[None, :],
             tl.where(special, 0xFF, exp + 127).to(tl.uint8),
             mask=(rows[:, None] < R) & (ks[None, :] < K // 32))


def quantize_mxfp4(x: torch.Tensor) -> MXFP4Tensor:
    """`moe_kernels.mxfp4.quantize` in one kernel, where the torch version runs 58
    operations. x [..., K] in any float dtype, with K a multiple of 32 and the last
    dimension dense or not, -> MXFP4 (packed [..., K/2], scales [..., K/32]). It is bit for
    bit the same on a device that keeps float32 denormals; the interpreter does, and a GPU
    run compares."""
    *lead, k = x.shape
    check_blockable(k)
    rows = _dense_last(x.reshape(-1, k))  # [R, K]
    packed = torch.empty(rows.shape[0], k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows.shape[0], k // BLOCK, dtype=torch.uint8, device=x.device)
    if rows.shape[0] and k:
        block_r, block_k = 16, 128
        grid = (triton.cdiv(rows.shape[0], block_r), triton.cdiv(k, block_k))
        with _on(x.device):
            _quantize_kernel[grid](rows, packed, scales, rows.shape[0], k, rows.stride(0),
                                   BLOCK_R=block_r, BLOCK_K=block_k)
    return MXFP4Tensor(packed.view(*lead, k // 2), scales.view(*lead, k // BLOCK))


def dequantize_mxfp4(q: MXFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`moe_kernels.mxfp4.dequantize` in one kernel pass: q [..., K] -> values [..., K] in
    `dtype`. This is exact in float32 and bfloat16, since MXFP4 values have at most 2
    mantissa bits and E8M0 scales are powers of two in float32's range. Rows may be strided
    views."""
    *lead, k = q.shape
    check_blockable(k)
    packed = q.packed.reshape(-1, k // 2)  # [R, K/2]: a view where the rows allow
    scales = q.scales.reshape(-1, k // BLOCK)  # [R, K/32]
    packed, scales = _dense_last(packed), _dense_last(scales)
    rows = packed.shape[0]
    out = torch.empty(rows, k, dtype=dtype, device=packed.device)  # [R, K]
    if rows and k:
        block_r, block_k = 16, 128
        grid = (triton.cdiv(rows, block_r), triton.cdiv(k, block_k))
        with _on(packed.device):
            _dequantize_kernel[grid](packed, scales, out, rows, k, packed.stride(0),
                                     scales.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)
    return out.view(*lead, k)


def _tile_schedule(offsets: torch.Tensor, n: int, block_n: int) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """Row tiles of at most `block_n` rows that never straddle two experts, computed on the
    device without a host synchronization.

    Arguments:
        offsets: `[E + 1]` int32, cumulative row offsets (expert e owns rows
            `offsets[e]:offsets[e + 1]`).
        n: the number of rows N (`offsets[-1]`, known on the host from the tensor shape).
        block_n: rows per tile.

    Returns:
        tile_expert: `[T]` int32, the expert of each tile; `E` for grid slots past the last
            tile. `T = cdiv(N, block_n) + E` bounds `sum_e cdiv(n_e, block_n)` from above.
        tile_row: `[T]` int32, the first row of each tile (meaningless where tile_expert is E).
    """
    e = offsets.numel() - 1
    counts = (offsets[1:] - offsets[:-1]).long()  # [E] rows per expert
    tiles = (counts + block_n - 1) // block_n  # [E] tiles per expert (0 for an empty expert)
    tiles_end = torch.cumsum(tiles, 0)  # [E] one past each expert's last tile
    t = torch.arange(triton.cdiv(n, block_n) + e, device=offsets.device)  # [T]
    tile_expert = torch.searchsorted(tiles_end, t, right=True)  # [T] in [0, E]
    safe = tile_expert.clamp(max=e - 1)  # [T]
    first_tile = tiles_end[safe] - tiles[safe]  # [T]
    tile_row = offsets[safe].long() + (t - first_tile) * block_n  # [T]
    return tile_expert.to(torch.int32), tile_row.to(torch.int32)


def _check_mxfp4(q: ScaledBlocks, name: str, ndim: int) -> None:
    if q.packed.dtype != torch.uint8 or q.scales.dtype != torch.uint8:
        raise ValueError(f"{name}: packed and scales must be uint8; got {q.packed.dtype}, "
                         f"{q.scales.dtype}")
    if q.packed.dim() != ndim:
        raise ValueError(f"{name}: expected an MXFP4 tensor of {ndim} dims; got shape "
                         f"{tuple(q.shape)}")
    k = q.shape[-1]
    check_blockable(k)
    if tuple(q.scales.shape) != (*q.packed.shape[:-1], k // BLOCK):
        raise ValueError(f"{name}: scales shape {tuple(q.scales.shape)} does not match "
                         f"packed shape {tuple(q.packed.shape)} (K = {k})")


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _dense_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _word_aligned(t: torch.Tensor) -> torch.Tensor:
    """t, with its last dim dense, copied if its start or any row stride is not a multiple
    of 4 bytes, as in `MXFP4Tensor.from_rows` views. "f16x2" loads codes as uint32 words."""
    if t.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in t.stride()[:-1]):
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


F16_CODES = ("f16", "f16x2")  # one MMA per 32-block: block_k may be 32


def grouped_mxfp4_gemm(
    x: MXFP4Tensor, expert_offsets: torch.Tensor, w: MXFP4Tensor | Bf16x2Weights, *,
    block_n: int | None = None, block_m: int | None = None, block_k: int | None = None,
    inner: str = "dot_scaled", swap_ab: bool = False, max_rows: int | None = None,
    split_k: int = 1, num_warps: int = 4, num_stages: int = 3,
) -> torch.Tensor:
    """Grouped W4A4 GEMM: each expert's rows of x times that expert's weights, transposed.

    Arguments:
        x: MXFP4 of `[N, K]` activations (packed `[N, K / 2]` uint8, scales `[N, K / 32]`
            uint8), rows sorted by expert. Row views with a non-unit row stride, such as
            `MXFP4Tensor.from_rows`, are read in place.
        expert_offsets: `[E + 1]` int32 or int64 on any device, cumulative row offsets:
            expert e owns rows `offsets[e]:offsets[e + 1]`, possibly empty. `offsets[0]` must
            be 0 and `offsets[E]` must be N; this is not checked, as that would need a host
            sync.
        w: MXFP4 of `[E, M, K]` weights (packed `[E, M, K / 2]` uint8, scales
            `[E, M, K / 32]` uint8), blocks along K; same device as x. For "bf16x2", the
            same in that layout (`moe_kernels.bf16x2_layout.to_bf16x2`).
        block_n, block_m, block_k: tile sizes, powers of two, at least 16. block_k is a
            multiple of 32 and at least 64, or at least 32 for "f16", "f16x2" and "bf16x2".
            By default block_n follows the mean rows per expert (16 to 64), block_m is 128,
            the best on an H200 (docs/benchmarks.md), and block_k is 128, or 32 for float16
            codes.
        inner: the inner product, exact up to the float32 summation order in every case.
            "dot_scaled" is `tl.dot_scaled`. "decode" and "bf16" decode in the kernel to
            float32, then run `tl.dot` in TF32 or in bfloat16. "f16" and "f16x2" use
            float16 codes, one MMA per 32-block with its product scaled, the codes decoded
            a byte or a 32-bit word at a time. "bf16x2" decodes the activations to bfloat16
            values first, and the weights, in the bf16x2 layout, by inline PTX for sm_80
            and later, two scaled values per instruction; it runs one bfloat16 MMA per K
            step.
        swap_ab: compute out.T = w @ x.T, so the weights are the MMA's left operand.
        max_rows: the most rows any expert has, if the caller knows it without a device
            sync. The grid is then E x cdiv(max_rows, block_n) row tiles, and the tile
            schedule, a few small kernels, is not built. It is not checked, as that would
            need a sync; rows beyond it are left unwritten.
        split_k: programs per output tile, each summing a share of K into its own
            partial output. The partials are then added in a fixed order, so the result is
            deterministic.
        num_warps, num_stages: launch options, which the interpreter ignores.

    Returns:
        `[N, M]` float32 on x's device: row r of expert e is `dequantize(x[r]) @
        dequantize(w[e]).T`, exact up to the float32 summation order.

    Raises:
        ValueError: K is not a multiple of 32, the shapes disagree, or the weights' layout
            is not the inner product's.
    """
    _check_mxfp4(x, "x", 2)
    _check_mxfp4(w, "w", 3)
    if isinstance(w, Bf16x2Weights) != (inner == "bf16x2"):
        raise ValueError(f"the {inner} inner product takes weights "
                         f"{'in the bf16x2 layout' if inner == 'bf16x2' else 'as MXFP4Tensor'}"
                         f"; got {type(w).__name__}")
    n, k = x.shape
    e, m, k_w = w.shape
    if k_w != k:
        raise ValueError(f"x has K = {k} but w has K = {k_w}")
    if e == 0 and n:
        raise ValueError("w has no experts but x has rows")
    if expert_offsets.dim() != 1 or expert_offsets.numel() != e + 1:
        raise ValueError(f"expert_offsets must have E + 1 = {e + 1} entries; got shape "
                         f"{tuple(expert_offsets.shape)}")
    if inner not in INNER_PRODUCTS:
        raise ValueError(f"unknown inner product {inner!r}; choose "
                         f"{', '.join(INNER_PRODUCTS)}")
    least = BLOCK if inner in (*F16_CODES, "bf16x2") else 2 * BLOCK
    block_k = block_k or (BLOCK if inner in F16_CODES else 128)
    if block_k & (block_k - 1) or block_k < least:  # 32 divides it, then
        raise ValueError(f"block_k must be a power of two, at least {least} for the {inner} "
                         f"inner product; got {block_k}")
    device = x.packed.device
    out = torch.empty(n, m, dtype=torch.float32, device=device)  # [N, M]
    if n == 0 or m == 0:
        return out
    if block_n is None:
        block_n = min(64, max(16, triton.next_power_of_2(triton.cdiv(n, e))))
    if block_m is None:  # the H200 sweep's best for dot_scaled at decode and prefill
        block_m = 128

    x_packed, x_scales = _dense_last(x.packed), _dense_last(x.scales)
    if inner == "bf16x2":  # the kernel reads values: decoded once, not per weight tile
        x_packed = x_scales = dequantize_mxfp4(x, torch.bfloat16)  # [N, K]
    w_packed, w_scales = _dense_last(w.packed), _dense_last(w.scales)
    if inner in ("f16x2", "bf16x2"):  # weight codes read as 32-bit words
        w_packed = _word_aligned(w_packed)
    offsets = expert_offsets.to(device=device, dtype=torch.int32)  # [E + 1]
    if max_rows is None:
        tile_expert, tile_row = _tile_schedule(offsets, n, block_n)  # [T], [T]
        tiles, per_expert = tile_expert.numel(), 0
    else:
        tile_expert = tile_row = offsets  # unused
        per_expert = max(1, triton.cdiv(max_rows, block_n))
        tiles = e * per_expert
    steps = triton.cdiv(k, block_k)
    split_k = max(1, min(split_k, steps))
    k_per_split = triton.cdiv(steps, split_k) * block_k  # whole K steps per split
    split_k = triton.cdiv(k, k_per_split)
    partial = out if split_k == 1 else torch.empty(split_k, n, m, dtype=torch.float32,
                                                   device=device)  # [S, N, M]
    grid = (tiles, triton.cdiv(m, block_m), split_k)
    with _on(device):
        _grouped_mxfp4_gemm_kernel[grid](
            x_packed, x_scales, w_packed, w_scales, partial, offsets, tile_expert, tile_row,
            m, k, e, per_expert, k_per_split,
            x_packed.stride(0), x_scales.stride(0),
            w_packed.stride(0), w_packed.stride(1), w_scales.stride(0), w_scales.stride(1),
            partial.stride(-2), partial.stride(0) if split_k > 1 else 0,
            BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, INNER=INNER_PRODUCTS[inner],
            SWAP_AB=swap_ab, DENSE=max_rows is not None, EVEN_K=k % block_k == 0,
            SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages,
        )
    return out if split_k == 1 else torch.sum(partial, dim=0, out=out)


def grouped_swiglu_w4a4_triton(
    x: MXFP4Tensor, tokens_per_expert: list[int] | torch.Tensor,
    w_gate_up: MXFP4Tensor | Bf16x2Weights, w_down: MXFP4Tensor | Bf16x2Weights,
    config: KernelConfig | None = None, max_rows: int | None = None,
) -> torch.Tensor:
    """`moe_kernels.grouped_gemm.grouped_swiglu_w4a4` with both GEMMs on the Triton kernel.

    Arguments:
        x: MXFP4 of `[N, H]` activations, rows grouped by local expert in expert order.
        tokens_per_expert: E_local ints summing to N; run e belongs to local expert e. It
            may instead be an `[E_local]` int64 tensor on x's device, with `max_rows` an
            upper bound of its entries, and then there is no host sync at all. The tensor is
            not checked, as that would need a host sync.
        w_gate_up: MXFP4 of `[E, 2 * I, H]` (gate first), blocks along H; E >= E_local.
        w_down: MXFP4 of `[E, H, I]`, blocks along I.
        config: the kernel's variant and tiles for both GEMMs. By default it is the one
            tuned for this GPU model and the most tokens any expert has
            (`moe_kernels.kernel_configs`), else `KernelConfig()`. Weights not in its
            layout are converted on each call (`to_bf16x2`), so callers that call again
            convert once, as `services.model.experts.ExpertBank` does.

    Returns:
        `[N, H]` float32 expert outputs on x's device, not yet weighted by the router. The
        SwiGLU output between the GEMMs is computed in float32 by torch and re-quantized to
        MXFP4 per row, as in the torch path.
    """
    n, _ = x.shape
    device = x.packed.device
    if isinstance(tokens_per_expert, torch.Tensor):
        if max_rows is None:
            raise ValueError("counts on the device need max_rows, a bound of every count")
        e, most = tokens_per_expert.shape[0], max_rows
    else:
        if sum(tokens_per_expert) != n or any(c < 0 for c in tokens_per_expert):
            raise ValueError(f"tokens_per_expert {tokens_per_expert} must be >= 0 and sum "
                             f"to {n}")
        e, most = len(tokens_per_expert), max(tokens_per_expert, default=0)
    offsets = F.pad(row_ends(tokens_per_expert, device), (1, 0))  # [E_local + 1] int32
    if e > w_gate_up.packed.shape[0] or e > w_down.packed.shape[0]:
        raise ValueError(f"{e} runs of tokens but only {w_gate_up.packed.shape[0]} experts")
    if config is None:
        config = tuned_config(
            torch.cuda.get_device_name(device) if device.type == "cuda" else None, most)
    on_device = isinstance(tokens_per_expert, torch.Tensor)
    w_gate_up, w_down = in_layout(w_gate_up[:e], config, on_device), \
        in_layout(w_down[:e], config, on_device)
    if config.route == "bf16_grouped_mm":
        return grouped_swiglu_w4a4_bf16(x, tokens_per_expert, w_gate_up, w_down)
    options = config.gemm_options()
    gate, up = grouped_mxfp4_gemm(x, offsets, w_gate_up, max_rows=most, **options
                                  ).chunk(2, dim=-1)  # [N, I] each
    act = quantize_mxfp4(F.silu(gate) * up)  # [N, I] -> MXFP4, per row
    return grouped_mxfp4_gemm(act, offsets, w_down, max_rows=most, **options)


def in_layout(w: MXFP4Tensor | Bf16x2Weights, config: KernelConfig, no_sync: bool = False
              ) -> MXFP4Tensor | Bf16x2Weights:
    """w in the layout `config`'s inner product reads. It converts only where the layouts
    differ. The conversion synchronises with the host, so `no_sync` callers must convert
    first."""
    if config.inner == "bf16x2" and config.route == "triton":
        if isinstance(w, Bf16x2Weights):
            return w
        if no_sync:
            raise ValueError("the bf16x2 inner product reads weights in its layout, and "
                             "converting them synchronises: convert first (to_bf16x2)")
        return to_bf16x2(w)
    if isinstance(w, Bf16x2Weights):
        raise ValueError(f"the {config.inner} inner product reads MXFP4Tensor weights, not the "
                         f"bf16x2 layout")
    return w


def grouped_swiglu_w4a4_bf16(x: MXFP4Tensor, tokens_per_expert: list[int] | torch.Tensor,
                             w_gate_up: MXFP4Tensor, w_down: MXFP4Tensor) -> torch.Tensor:
    """`grouped_swiglu_w4a4_triton`'s result by another route, the one
    `KernelConfig(route="bf16_grouped_mm")` selects. Both operands of each GEMM are decoded
    exactly to bfloat16 (`dequantize_mxfp4`), then multiplied by bf16 grouped GEMMs
    (`torch._grouped_mm`).

    It is a candidate for many tokens per expert, where the Triton kernel's decode-sized
    tiles lose to bf16 (docs/benchmarks.md); it has not yet been timed on a GPU. It decodes
    the experts' weights on every call, into a transient bf16 copy of each GEMM's weights:
    2 bytes per weight, 3.8x what they hold in MXFP4. Counts are as for
    `grouped_swiglu_w4a4_triton`, except that a device tensor needs no bound here.
    torch._grouped_mm returns its inputs' dtype, so the GEMMs' outputs are rounded to
    bfloat16, where the torch path keeps float32.

    Returns:
        `[N, H]` float32 expert outputs, as `grouped_swiglu_w4a4_triton`.
    """
    ends = row_ends(tokens_per_expert, x.packed.device)  # [E_local] int32
    e = ends.shape[0]
    w1 = dequantize_mxfp4(w_gate_up[:e])  # [E, 2I, H] bf16
    gate, up = torch._grouped_mm(dequantize_mxfp4(x), w1.transpose(-2, -1), offs=ends
                                 ).float().chunk(2, dim=-1)  # [N, I] each
    act = quantize_mxfp4(F.silu(gate) * up)  # [N, I] -> MXFP4, per row
    w2 = dequantize_mxfp4(w_down[:e])  # [E, H, I] bf16
    return torch._grouped_mm(dequantize_mxfp4(act), w2.transpose(-2, -1), offs=ends).float()
