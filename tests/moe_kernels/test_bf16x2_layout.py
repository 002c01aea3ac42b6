"""The bf16x2 weight layout (moe_kernels.bf16x2_layout): a lossless rearrangement whose
decode, the kernel's inline PTX (`PTX`: rotate, mask, one bfloat16 multiply per pair) run
by tests/ptx.py after the PTX ISA's semantics, gives every value
`moe_kernels.mxfp4.dequantize` gives (the OCP MX decode, test_mxfp4.py), bit for bit, in K
order. test_triton_mxfp4.py runs the whole kernel, the same asm text included, in Triton's
interpreter; benchmarks/gpu_check.py checks a GPU agrees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_kernels.bf16x2_layout import (
    MAX_SCALE,
    PAIR_BASE,
    PAIR_STEP,
    PTX,
    PTX_CONSTRAINTS,
    Bf16x2Weights,
    from_bf16x2,
    to_bf16x2,
)
from moe_kernels.mxfp4 import MXFP4Tensor, dequantize
from tests.support import ptx


def decode_as_ptx(w: Bf16x2Weights) -> torch.Tensor:
    """[..., K] float32: the kernel's asm text (`PTX`) run word by word on the bytes."""
    *lead, half = w.packed.shape
    # [..., W]: bytes 4c..4c+3 as a little-endian word, as a GPU reads them (and x86)
    words = w.packed.reshape(*lead, half // 4, 4).numpy().view("<u4")[..., 0]
    scales = w.scales.repeat_interleave(4, dim=-1).numpy().astype(np.uint32)  # per word
    h = ptx.run(PTX, PTX_CONSTRAINTS, [words, scales * PAIR_STEP + PAIR_BASE])
    out = torch.empty(*lead, half // 16, 32, dtype=torch.float32)  # [..., block, k]
    for j in range(4):
        for t in (0, 1):
            value = torch.from_numpy(h[2 * j + t].astype(np.int16)).view(torch.bfloat16)
            for c in range(4):  # word c of each block: code 2c + 8j + t
                out[..., 2 * c + 8 * j + t] = value.reshape(*lead, half // 16, 4)[..., c]
    return out.reshape(*lead, 2 * half)


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
