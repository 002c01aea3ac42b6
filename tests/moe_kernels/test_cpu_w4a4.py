"""The compiled CPU kernels for W4A4 experts (`moe_kernels/csrc/w4a4_cpu.cpp`):

- the quantizer, bit for bit `moe_kernels.mxfp4.quantize` (itself checked against the OCP MX
  rules and torchao in test_mxfp4.py), on its edge cases and on fuzzed float32 bit patterns;
- one MXFP4 GEMM against float64 products of the decoded values, and on a block worked out
  by hand from the spec's tables;
- the grouped SwiGLU against the torch path (`grouped_swiglu_w4a4`) with uneven, empty and
  prefill-sized experts, each expert timed on its own, and through `ExpertBank`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis.extra.numpy import arrays

from moe_kernels import cpu_kernels
from moe_kernels.grouped_gemm import grouped_swiglu_w4a4
from moe_kernels.mxfp4 import MXFP4Tensor, dequantize, quantize
from moe_kernels.panels import MXFP4Panels, plain_mxfp4
from moe_kernels.selection import cpu_grouped_swiglu_w4a4, panels_for_cpu
from tests.support.kernels import assert_expert_spans

pytestmark = pytest.mark.timeout(300)


def cpp_quantize(kernel: object, x: torch.Tensor) -> MXFP4Tensor:
    return MXFP4Tensor(*kernel.quantize_mxfp4(x))  # type: ignore[attr-defined]


def test_the_quantizer_matches_the_torch_one_on_the_edge_cases(kernel: object) -> None:
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # each rounding boundary
    block = torch.cat([ties, -ties, ties * 0.999, ties * 1.001])  # [32], amax 6.006: 2**0
    rows = [block, block * 2.0**-130, block * 2.0**120,  # a scale clamped at -127; a large one
            torch.zeros(32), torch.full((32,), -0.0),  # zero blocks keep their signs
            torch.tensor([1e-45, -1e-45] * 16),  # float32 denormals
            torch.tensor([float("nan")] + [1.0] * 31), torch.tensor([float("-inf")] + [0.5] * 31),
            torch.tensor([3.4e38] * 32), torch.randn(32) * 1e-3]
    x = torch.stack(rows).repeat(1, 2)  # [10, 64]: two blocks per row
    got, want = cpp_quantize(kernel, x), quantize(x)
    assert torch.equal(got.packed, want.packed) and torch.equal(got.scales, want.scales)


@settings(max_examples=60, deadline=None)
@given(arrays(np.uint32, (4, 64)))
def test_the_quantizer_matches_on_any_float32_bits(bits: np.ndarray) -> None:
    kernel = cpu_kernels.cpu_kernels()
    assert kernel is not None
    x = torch.from_numpy(bits.view(np.float32).copy())  # NaNs, infs, denormals included
    got, want = cpp_quantize(kernel, x), quantize(x)
    assert torch.equal(got.packed, want.packed) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("blocks", [1, 2, 4])  # K = 32 (AVX2), 64 (AVX-512), 128 (VNNI)
def test_one_gemm_on_a_block_worked_out_from_the_spec(kernel: object, blocks: int) -> None:
    # x: the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 (codes 0-7, summing to 18) three times,
    # then negated once (codes 8-15), at scale 2**1 (E8M0 byte 128); w: all 1.0 (code 2).
    # x . w = (3 * 18 - 18) * 2**1 * (w's scale), per block.
    codes = torch.arange(8, dtype=torch.uint8)
    x_codes = torch.cat([codes, codes, codes, codes | 8])  # [32]
    x = MXFP4Tensor((x_codes[0::2] | (x_codes[1::2] << 4))[None].repeat(1, blocks),
                    torch.full((1, blocks), 128, dtype=torch.uint8))
    w = MXFP4Tensor(torch.full((3, 16 * blocks), 0x22, dtype=torch.uint8),
                    torch.tensor([[124], [255], [0]], dtype=torch.uint8).repeat(1, blocks))
    y = kernel.mxfp4_linear(x.packed, x.scales, w.packed, w.scales)  # type: ignore[attr-defined]
    # scales 2**-3, NaN, 2**-127
    assert y[0, 0].item() == 9.0 * blocks and y[0, 1].isnan()
    assert y[0, 2].item() == 72 * blocks * 2.0**-127


@pytest.mark.parametrize(("m", "n", "k"), [(1, 5, 32), (7, 300, 1024), (70, 33, 96), (0, 4, 64)])
def test_one_gemm_is_exact_products_summed_in_float32(kernel: object, m: int, n: int,
                                                      k: int) -> None:
    g = torch.Generator().manual_seed(m + n)
    x, w = quantize(torch.randn(m, k, generator=g)), quantize(torch.randn(n, k, generator=g) / 9)
    y = kernel.mxfp4_linear(x.packed, x.scales, w.packed, w.scales)  # type: ignore[attr-defined]
    want = dequantize(x).double() @ dequantize(w).double().T  # every product exact
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)


def mxfp4_experts(experts: int, hidden: int, inter: int, seed: int
                  ) -> tuple[MXFP4Tensor, MXFP4Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (quantize(torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5),
            quantize(torch.randn(experts, hidden, inter, generator=g) / inter**0.5))


@pytest.mark.parametrize(("counts", "hidden", "inter"), [
    ([1], 64, 32),  # a decode of one token
    ([0, 1, 3, 0, 2, 4, 0, 1], 64, 96),  # uneven, with empty experts
    ([5, 70, 0, 130], 128, 64),  # prefill-sized: more than one 64-row tile
    ([0, 0, 0], 64, 32),  # no rows at all
    ([2, 7, 1, 9], 1024, 768),  # the benchmarks' mid-size shapes
])
def test_the_grouped_kernel_equals_the_torch_path(kernel: object, counts: list[int],
                                                  hidden: int, inter: int) -> None:
    w_gate_up, w_down = mxfp4_experts(len(counts), hidden, inter, seed=sum(counts))
    x = quantize(torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(1)))
    want = grouped_swiglu_w4a4(x, counts, w_gate_up, w_down)
    spans: list[tuple[int, int]] = []
    got = cpu_grouped_swiglu_w4a4(x, counts, w_gate_up, w_down, spans)
    assert got is not None and got.shape == want.shape and got.dtype == torch.float32
    # Summation order only. (A SwiGLU output within an ulp of an E2M1 rounding boundary
    # could re-quantize to the neighbouring code; these fixed inputs have none.)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_expert_spans(spans, counts)


def test_panels_are_the_same_weights_and_give_the_same_outputs(kernel: object) -> None:
    counts = [3, 0, 1, 6]
    w_gate_up, w_down = mxfp4_experts(len(counts), 256, 128, seed=5)
    w_gate_up.scales[0, 7, 2] = 255  # a NaN block travels with its column
    x = quantize(torch.randn(sum(counts), 256, generator=torch.Generator().manual_seed(2)))
    p_gate_up, p_down = panels_for_cpu(w_gate_up), panels_for_cpu(w_down)
    if not isinstance(p_gate_up, MXFP4Panels):
        pytest.skip("this CPU has no AVX512-VNNI: the kernel reads MXFP4 as stored")
    assert isinstance(p_down, MXFP4Panels) and p_gate_up.shape == w_gate_up.shape
    for panels, w in ((p_gate_up, w_gate_up), (p_down, w_down)):
        assert panels.nbytes() == w.nbytes()  # re-ordered, not grown
        back = plain_mxfp4(panels)
        assert torch.equal(back.packed, w.packed) and torch.equal(back.scales, w.scales)
    got = cpu_grouped_swiglu_w4a4(x, counts, p_gate_up, p_down, None)
    want = cpu_grouped_swiglu_w4a4(x, counts, w_gate_up, w_down, None)  # panels made per call
    assert got is not None and want is not None and got[:3].isnan().all()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # bit for bit


def test_nan_in_a_row_stays_in_that_row(kernel: object) -> None:
    w_gate_up, w_down = mxfp4_experts(2, 64, 32, seed=3)
    rows = torch.randn(4, 64)
    rows[1, 7] = float("nan")
    x = quantize(rows)
    got = cpu_grouped_swiglu_w4a4(x, [3, 1], w_gate_up, w_down, None)
    assert got is not None
    assert got[1].isnan().all() and not got[[0, 2, 3]].isnan().any()
    torch.testing.assert_close(got, grouped_swiglu_w4a4(x, [3, 1], w_gate_up, w_down),
                               equal_nan=True, rtol=1e-5, atol=1e-5)


def test_bad_input_is_refused_with_its_reason(kernel: object) -> None:
    w_gate_up, w_down = mxfp4_experts(2, 64, 32, seed=0)
    x = quantize(torch.randn(3, 64))
    args = (w_gate_up.packed, w_gate_up.scales, w_down.packed, w_down.scales)
    for counts, reason in [([1, 1], "do not sum to the rows"), ([4, -1], "negative count"),
                           ([3], "one count per local expert")]:
        with pytest.raises(RuntimeError, match=reason):
            kernel.grouped_swiglu_w4a4(x.packed, x.scales, counts, *args)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="uint8"):
        kernel.grouped_swiglu_w4a4(x.packed.int(), x.scales, [1, 2], *args)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="do not match"):
        kernel.grouped_swiglu_w4a4(x.packed, x.scales, [1, 2], w_down.packed, w_down.scales,  # type: ignore[attr-defined]
                                   w_down.packed, w_down.scales)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.quantize_mxfp4(torch.randn(2, 48))  # type: ignore[attr-defined]
