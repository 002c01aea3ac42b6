"""The 8-bit dense scheme's GPU form (`moe_kernels.fp8`): FP8 E4M3 weights with a scale per
output channel and activations quantized per row, through `torch._scaled_mm`. Run here by
torch's CPU implementation of `_scaled_mm`, for the shapes, the layout and the errors; on
a GPU the same calls run FP8 tensor cores (`benchmarks/gpu_check`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_kernels import int8
from moe_kernels.fp8 import FP8, FP8_MAX, fp8_linear, fp8_weights, quantize_rows, reference_linear
from moe_kernels.int8 import Int8Panels
from moe_kernels.selection import dense_weight, linear


def test_rows_take_their_own_scale() -> None:
    """s = max|row| / 448 (E4M3's largest), each row's largest exact; a zero row s = 1."""
    x = torch.tensor([[1.0, -3.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 2e-3, -4e-3]])
    q, s = quantize_rows(x)
    assert q.dtype == FP8 and s.shape == (3, 1)
    assert torch.equal(s[[0, 2], 0], torch.tensor([3.0, 4e-3]) / FP8_MAX) and s[1] == 1.0
    assert (q.float() * s)[0, 1] == -3.0 and not q[1].float().any()
    # E4M3 keeps 3 mantissa bits: every value within 1/16 of itself
    assert ((q.float() * s - x).abs() <= x.abs() / 16 + 1e-12).all()


@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 16), (3, 40, 64), (17, 100, 48), (0, 32, 32)])
def test_the_linear_is_the_dequantized_operands_product(m: int, n: int, k: int) -> None:
    """Uneven N (padded to 16 at load, cut from the output) and M, against the float32
    product of the dequantized operands, and near the float product."""
    g = torch.Generator().manual_seed(m + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    f = fp8_weights(w)
    assert f is not None and f.shape == (n, k) and f.weight.shape[0] % 16 == 0
    y = fp8_linear(x, f)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, reference_linear(x, f), rtol=1e-5, atol=1e-5)
    if m:
        err = (y - F.linear(x, w)).norm() / F.linear(x, w).norm()
        assert err < 0.06, float(err)
    assert fp8_linear(x.to(torch.bfloat16), f).dtype == torch.bfloat16


def test_what_scaled_mm_cannot_take_is_said() -> None:
    assert fp8_weights(torch.randn(32, 24)) is None  # K no multiple of 16: stays as is
    with pytest.raises(ValueError, match="x has K = 32, the FP8 weight"):
        fp8_linear(torch.randn(2, 32), fp8_weights(torch.randn(16, 48)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown dense quantization 'int4'"):
        dense_weight(torch.randn(16, 16), "int4", torch.float32)


def test_the_scheme_picks_the_layout_by_device() -> None:
    """On the CPU the scheme is int8 panels; a stored (q, s) is laid out as it is."""
    w = torch.randn(20, 32)
    packed = dense_weight(w, "int8", torch.float32)
    assert isinstance(packed, Int8Panels)
    again = dense_weight((packed.dequantize().round().to(torch.int8), torch.ones(20)), "int8",
                         torch.float32)
    assert isinstance(again, Int8Panels) and torch.equal(again.scales[:20], torch.ones(20))
    x = torch.randn(3, 32)
    torch.testing.assert_close(linear(x, packed), int8.reference_linear(x, packed))
