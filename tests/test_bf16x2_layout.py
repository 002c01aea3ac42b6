"""The bf16x2 weight layout (moe_kernels.bf16x2_layout): a lossless rearrangement whose
decode, as the kernel's inline PTX does it (rotate, mask, one bfloat16 multiply per pair),
gives every value `moe_kernels.mxfp4.dequantize` gives (the OCP MX decode, test_mxfp4.py),
bit for bit, in K order. The PTX itself runs on a GPU only (benchmarks/gpu_check.py
compares the kernel with the torch path); test_triton_mxfp4.py runs the kernel with the
same operations in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_kernels.bf16x2_layout import (
    MASK,
    MAX_SCALE,
    ROTATIONS,
    Bf16x2Weights,
    from_bf16x2,
    to_bf16x2,
)
from moe_kernels.mxfp4 import MXFP4Tensor, dequantize


def rotr(words: torch.Tensor, n: int) -> torch.Tensor:
    return ((words >> n) | (words << (32 - n))) & 0xFFFFFFFF if n else words


def decode_as_ptx(w: Bf16x2Weights) -> torch.Tensor:
    """[..., K] float32: `_bf16x2_asm`'s arithmetic, word by word, from the bytes."""
    *lead, half = w.packed.shape
    b = w.packed.reshape(*lead, half // 4, 4).long()
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)  # [..., W]
    scale = torch.exp2(w.scales.double() - 127 + 126).repeat_interleave(4, dim=-1)  # per word
    regs = [rotr(words, ROTATIONS[j][0]) & MASK for j in range(3)]
    regs.append((rotr(words, 14) & 0x00400040) | (rotr(words, 6) & 0x81808180))
    out = torch.empty(*lead, half // 16, 32, dtype=torch.float64)  # [..., block, k]
    for j, reg in enumerate(regs):
        for t in (0, 1):
            bits = ((reg >> (16 * t)) & 0xFFFF).int() << 16  # bfloat16 -> float32 bits
            value = bits.view(torch.float32).double() * scale  # code * 2**-126 * 2**(s - 1)
            for c in range(4):  # word c of each block: code 2c + 8j + t
                out[..., 2 * c + 8 * j + t] = value.reshape(*lead, half // 16, 4)[..., c]
    return out.reshape(*lead, 2 * half).float()


def random_weights(shape: tuple[int, ...], seed: int, max_scale: int = MAX_SCALE) -> MXFP4Tensor:
    g = torch.Generator().manual_seed(seed)
    *lead, k = shape
    return MXFP4Tensor(torch.randint(0, 256, (*lead, k // 2), dtype=torch.uint8, generator=g),
                       torch.randint(0, max_scale + 1, (*lead, k // 32), dtype=torch.uint8,
                                     generator=g))


def test_every_code_and_scale_decodes_to_the_mx_value() -> None:
    """All 256 bytes (every pair of codes) under every scale byte the layout takes, 0
    (2**-127, subnormal products) to 128 (2**1)."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(129, 1)  # [129, 256]: K = 512
    scales = torch.arange(129, dtype=torch.uint8)[:, None].repeat(1, 16)  # [129, 16]
    w = MXFP4Tensor(packed, scales)
    got = decode_as_ptx(to_bf16x2(w))
    want = dequantize(w)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 included


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), blocks=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1))
def test_round_trip_and_decode_any_shape(lead: list[int], blocks: int, seed: int) -> None:
    w = random_weights((*lead, 32 * blocks), seed)
    layout = to_bf16x2(w)
    assert layout.shape == w.shape and layout.packed.dtype == torch.uint8
    back = from_bf16x2(layout)
    assert torch.equal(back.packed, w.packed) and torch.equal(back.scales, w.scales)
    assert torch.equal(decode_as_ptx(layout).view(torch.int32), dequantize(w).view(torch.int32))


def test_conversion_in_chunks_of_rows_is_the_same() -> None:
    w = random_weights((3, 5, 96), seed=4)
    whole = to_bf16x2(w)
    for chunk in (48, 100, 1):  # one row, two rows, a row at a time (at least one)
        assert torch.equal(to_bf16x2(w, chunk_bytes=chunk).packed, whole.packed)
    empty = random_weights((0, 5, 96), seed=4)
    assert to_bf16x2(empty).packed.shape == (0, 5, 48)


def test_slicing_experts_slices_the_layout() -> None:
    w = random_weights((4, 6, 64), seed=1)
    layout = to_bf16x2(w)
    assert torch.equal(from_bf16x2(layout[1:3]).packed, w[1:3].packed)


@pytest.mark.parametrize("scale", [MAX_SCALE + 1, 254, 0xFF], ids=["2**2", "2**127", "NaN"])
def test_scales_the_layout_cannot_apply_are_refused(scale: int) -> None:
    w = random_weights((2, 3, 64), seed=2)
    w.scales[1, 2, 1] = scale
    with pytest.raises(ValueError, match=f"every block scale <= 2\\*\\*1 .*scale byte {scale}"):
        to_bf16x2(w)
