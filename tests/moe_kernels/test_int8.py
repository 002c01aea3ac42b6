"""Dense weights in 8 bits (`moe_kernels.int8`): the scheme's rules, and the CPU kernel
(`linear_i8`: activations quantized in blocks of 32, integer products) against torch's
matmul over the dequantized operands, for uneven shapes and every family's dense
weights."""

from __future__ import annotations

import pytest
import torch

from moe_kernels import cpu_kernels
from moe_kernels.int8 import (
    BLOCK,
    QMAX,
    dequantized_activations,
    int8_panels,
    quantize_activations,
    quantize_int8,
)
from moe_kernels.selection import linear
from services.model.checkpoint import Checkpoint


def assert_rounding_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y [M, N] is x [M, K] @ w [N, K]^T up to float32 rounding: within 1e-5 of the sum of
    the products' magnitudes (float64 reference), whatever K."""
    exact = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-7
    assert ((y.double() - exact).abs() <= bound).all(), float((y.double() - exact).abs().max())


def test_each_row_takes_its_own_scale_and_rounds_to_nearest() -> None:
    """s = max|row| / 127; q = round(w / s) within [-127, 127]; a zero row is s = 1, q = 0;
    every weight is within half a step of q * s, and a row's largest is exact."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 37, generator=g) * torch.tensor([1.0, 1e-3, 50.0, 0.0, 2.0])[:, None]
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape
    assert torch.equal(s[[0, 1, 2, 4]], w[[0, 1, 2, 4]].abs().amax(1) / QMAX)
    assert s[3] == 1.0 and not q[3].any()
    assert int(q.abs().max()) == QMAX
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 * (1 + 1e-6)).all()
    grid = torch.arange(-QMAX, QMAX + 1, dtype=torch.float32)[None] * 0.25  # q * s exactly
    assert torch.equal(quantize_int8(grid)[0].float() * 0.25, grid)


def test_activations_take_a_scale_per_block_of_32() -> None:
    """A row's blocks of 32 along K each by the weights' rule, K padded with zeros: an
    outlier costs its own block's precision, not the row's."""
    x = torch.randn(3, 70) * 0.1
    x[1, 5] = 300.0  # in block 0 of row 1
    q, s = quantize_activations(x)
    assert q.shape == (3, 96) and s.shape == (3, 3) and not q[:, 70:].any()
    for r in range(3):
        for b in range(3):
            block = x[r, b * BLOCK:(b + 1) * BLOCK]
            assert s[r, b] == block.abs().amax() / QMAX
            assert torch.equal(q[r, b * BLOCK:b * BLOCK + len(block)],
                               torch.round(block / s[r, b]).to(torch.int8))
    xd = dequantized_activations(x)
    assert ((xd - x).abs()[1, BLOCK:] <= s[1, 1:].repeat_interleave(BLOCK)[:70 - BLOCK] / 2
            * (1 + 1e-6)).all()  # the blocks after the outlier keep their precision


@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (1, 37, 19), (3, 16, 64),
                                           (6, 261, 128), (7, 100, 33), (50, 48, 200)])
def test_the_kernel_is_torchs_matmul_over_the_dequantized_weights(
        kernel: object, m: int, n: int, k: int) -> None:
    """Uneven rows, columns (padded to panels of 16) and K, against x @ (q * s)^T."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    packed = int8_panels(w)
    assert packed.shape == (n, k) and packed.panels.dtype == torch.int8
    assert torch.equal(packed.quantized(), quantize_int8(w)[0])
    assert_rounding_close(linear(x, packed), dequantized_activations(x), packed.dequantize())
    # strided rows of x take the same path
    wide = torch.randn(m, k + 3, generator=g)[:, :k]
    assert_rounding_close(linear(wide, packed), dequantized_activations(wide),
                          packed.dequantize())


@pytest.mark.parametrize(("t", "heads", "n", "k"), [(1, 2, 16, 24), (5, 3, 48, 7),
                                                     (50, 4, 32, 64)])
def test_per_head_weights_take_their_own_scales(kernel: object, t: int, heads: int, n: int,
                                                k: int) -> None:
    """MLA's absorbed W_UK and W_UV, one [N, K] matrix per head with a scale per head and
    channel, through `head_linear_i8` against torch over the dequantized weights."""
    from services.attention.mla import head_linear

    g = torch.Generator().manual_seed(t + n)
    w = torch.randn(heads, n, k, generator=g) * torch.rand(heads, n, 1, generator=g)
    x = torch.randn(t, heads, k + 2, generator=g)[..., :k]  # strided heads, as MLA's q
    packed = int8_panels(w)
    assert packed.scales.shape == (heads, n) and packed.shape == (heads, n, k)
    for h in range(heads):
        assert torch.equal(packed.dequantize()[h], int8_panels(w[h]).dequantize())
    y = head_linear(x, packed)  # [T, heads, N]
    for h in range(heads):
        assert_rounding_close(y[:, h], dequantized_activations(x[:, h]),
                              packed.dequantize()[h])


def test_every_familys_dense_weights(kernel: object, every_ckpt: tuple) -> None:
    """Each 2-D dense weight of the checkpoint (projections, MLA's, gates, lm_head; not
    the routed experts) through the kernel at 1, 3 and 17 rows, against the reference;
    and each output within the quantization's own bound of float32's: with x' and w' the
    dequantized operands, |x' . w' - x . w| <= |x' - x| |w| + |x'| |w' - w|
    (Cauchy-Schwarz), which a wrong scale or weight would break."""
    path = every_ckpt[0]
    g = torch.Generator().manual_seed(5)
    with Checkpoint(path) as ckpt:
        names = [n for n in ckpt.names() if ".experts." not in n and n.endswith("weight")
                 and len(ckpt.shape(n)) == 2 and "embed" not in n]
        assert any("lm_head" in n for n in names) or any("q_a_proj" in n for n in names)
        for name in names:
            w = ckpt.get(name, ckpt.shape(name), torch.float32)
            packed = int8_panels(w)
            for m in (1, 3, 17):
                x = torch.randn(m, w.shape[1], generator=g)
                y, xd = linear(x, packed), dequantized_activations(x)
                assert_rounding_close(y, xd, packed.dequantize())
                bound = (xd - x).norm(dim=1)[:, None] * w.norm(dim=1)[None] + \
                    xd.norm(dim=1)[:, None] * (packed.dequantize() - w).norm(dim=1)[None]
                assert ((y - x @ w.T).abs() <= bound * (1 + 1e-4) + 1e-5).all(), name


def test_without_the_kernels_torch_computes_the_same() -> None:
    """With the kernels switched off (`SWITCHYARD_CPU_KERNELS=0`, or a machine that could
    not build them) the int8 weights go through torch's matmul, dequantized."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 24, generator=g), torch.randn(4, 24, generator=g)
    packed = int8_panels(w)
    with_kernels = linear(x, packed)
    cpu_kernels.set_enabled(False)
    try:
        without = linear(x, packed)
    finally:
        cpu_kernels.set_enabled(True)
    assert_rounding_close(without, dequantized_activations(x), packed.dequantize())
    assert_rounding_close(with_kernels, dequantized_activations(x), packed.dequantize())
