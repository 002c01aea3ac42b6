"""MXFP4 quantization against hand-computed bytes (OCP MX v1.0) and against torchao's
independent implementation; the W4A4 grouped FFN against a float reference."""

from __future__ import annotations

import math

import pytest
import torch

from moe_kernels.grouped_gemm import grouped_swiglu, grouped_swiglu_w4a4
from moe_kernels.mxfp4 import BLOCK, MXFP4Tensor, dequantize, quantize
from tests.support.tools import missing


def block(*values: float) -> torch.Tensor:
    """One 32-value block: `values`, then zeros."""
    return torch.tensor([*values, *[0.0] * (BLOCK - len(values))])


def codes(q: MXFP4Tensor) -> list[int]:
    """The 4-bit codes in value order (low nibble first)."""
    flat = q.packed.reshape(-1)
    return [c for byte in flat.tolist() for c in (byte & 0xF, byte >> 4)]


def test_the_e2m1_grid_encodes_to_its_codes() -> None:
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    q = quantize(block(*grid, *[-g for g in grid]))
    assert q.scales.tolist() == [127]  # amax 6: floor(log2 6) - 2 = 0
    assert q.packed[:8].tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert dequantize(q)[:16].tolist() == [*grid, *[-g for g in grid]]


def test_ties_round_to_even_codes() -> None:
    # amax 5 -> X = 0; each value sits exactly between two grid points.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0]
    q = quantize(block(*ties))
    assert q.scales.tolist() == [127]
    assert codes(q)[:9] == [0, 2, 2, 4, 4, 6, 6, 8 | 2, 8 | 6]
    assert dequantize(q)[:9].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0]


def test_values_above_six_saturate() -> None:
    q = quantize(block(7.9, -7.0, 6.5, 0.3))
    assert q.scales.tolist() == [127]  # floor(log2 7.9) = 2
    assert codes(q)[:4] == [7, 8 | 7, 7, 1]
    assert dequantize(q)[:4].tolist() == [6.0, -6.0, 6.0, 0.5]


def test_power_of_two_amax_lands_on_four() -> None:
    for amax, scale in ((8.0, 128), (1.0, 125), (2.0**-20, 105)):
        q = quantize(block(amax, -amax / 2))
        assert q.scales.tolist() == [scale]  # X = log2(amax) - 2
        assert codes(q)[:2] == [6, 8 | 4]  # 4 and -2 after scaling
        assert dequantize(q)[:2].tolist() == [amax, -amax / 2]


def test_zero_block_gets_the_smallest_scale_and_keeps_signs() -> None:
    q = quantize(torch.zeros(BLOCK))
    assert q.scales.tolist() == [0] and q.packed.tolist() == [0] * 16
    signed = quantize(block(-0.0, 6.0, -0.1))  # -0.1 rounds to zero, keeping its sign
    assert codes(signed)[:3] == [8, 7, 8]
    out = dequantize(signed)
    assert out[0].item() == 0 and math.copysign(1, out[0].item()) == -1
    assert math.copysign(1, out[2].item()) == -1


def test_denormal_inputs() -> None:
    smallest_normal = 2.0**-126
    q = quantize(block(smallest_normal, 1e-40))
    assert q.scales.tolist() == [0]  # X = -128 clamps to -127
    assert codes(q)[:2] == [4, 0]  # 2**-126 / 2**-127 = 2; 1e-40 * 2**127 ~ 0.017 -> 0
    assert dequantize(q)[:2].tolist() == [smallest_normal, 0.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_make_the_block_nan(bad: float) -> None:
    x = torch.stack([block(1.0, bad), block(1.0, 2.0)])
    q = quantize(x)
    assert q.scales[:, 0].tolist() == [0xFF, 126]  # amax 2: X = 1 - 2
    out = dequantize(q)
    assert out[0].isnan().all() and out[1, :2].tolist() == [1.0, 2.0]


def test_round_trip_error_is_within_half_a_grid_step() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-6, 6, 256)  # many magnitudes
    q = quantize(x)
    assert q.packed.shape == (64, 128) and q.scales.shape == (64, 8)
    out = dequantize(q)
    scale = torch.exp2(q.scales.float() - 127).repeat_interleave(BLOCK, dim=1)
    s = x.abs() / scale  # what was rounded, < 8
    # E2M1's grid steps: 0.5 up to 2, 1 up to 4, 2 up to 6; beyond 6 it saturates.
    step = torch.where(s <= 2, 0.5, torch.where(s <= 4, 1.0, 2.0))
    bound = torch.where(s <= 6, step / 2, s - 6) * scale
    assert ((out - x).abs() <= bound).all()
    # OCP MX: scale 2**(floor(log2(amax)) - 2), so each block's amax / scale is in [4, 8)
    block_top = s.view(64, 8, BLOCK).amax(-1)
    assert (block_top >= 4).all() and (block_top < 8).all()


def test_bytes_equal_torchao_on_finite_data() -> None:
    try:
        from torchao.prototype.mx_formats import mx_tensor as mx
    except ImportError:
        missing("torchao (the independent MX reference)", "pip install -e .[test]")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 512, generator=g) * torch.logspace(-30, 30, 512)
    x[3, :64] = 0.0  # zero blocks
    x[4, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.5] * 4)  # ties, sat.
    scales, packed = mx.to_mx(x, torch.float4_e2m1fn_x2, BLOCK)
    ours = quantize(x)
    assert torch.equal(ours.scales, scales.view(torch.uint8).reshape(ours.scales.shape))
    assert torch.equal(ours.packed, packed.view(torch.uint8).reshape(ours.packed.shape))


def test_dimension_not_a_multiple_of_32_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.ones(4, 48))


def test_rows_round_trip_for_the_wire() -> None:
    q = quantize(torch.randn(5, 64))
    rows = q.to_rows()
    assert rows.shape == (5, 32 + 2) and rows.dtype == torch.uint8
    back = MXFP4Tensor.from_rows(rows, 64)
    assert torch.equal(back.packed, q.packed) and torch.equal(back.scales, q.scales)


def test_w4a4_ffn_is_close_to_float() -> None:
    g = torch.Generator().manual_seed(2)
    e, h, i = 3, 64, 96
    counts = [5, 0, 3]
    x = torch.randn(sum(counts), h, generator=g)
    w_gate_up = torch.randn(e, 2 * i, h, generator=g) / 8
    w_down = torch.randn(e, h, i, generator=g) / 8
    want = grouped_swiglu(x, counts, w_gate_up, w_down)
    got = grouped_swiglu_w4a4(quantize(x), counts, quantize(w_gate_up), quantize(w_down))
    rel = (got - want).norm() / want.norm()
    # Measured: one MXFP4 round trip of Gaussian data is ~11.5% relative error, a W4A4
    # GEMM ~16%, this FFN (three quantizations, two GEMMs, SwiGLU) 31%.
    assert rel < 0.4, rel
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.9
