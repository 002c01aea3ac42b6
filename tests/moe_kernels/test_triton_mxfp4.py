"""The Triton W4A4 grouped GEMM (moe_kernels.triton_mxfp4) against the torch path
(`mxfp4_linear` per expert, `grouped_swiglu_w4a4`).

On a CPU this runs the kernels in Triton's interpreter (TRITON_INTERPRET=1, set below before
anything imports triton) and expects bit-identical results: every MXFP4 value and product is
exact in float32, and at these shapes every partial sum is too, so the summation order of the
kernel and of torch's matmul cannot matter. The interpreter is taught inline PTX and
bfloat16 dots first (tests/triton_interpreter.py), so every inner product runs as written.
With TRITON_INTERPRET=0 on a CUDA machine the same tests run on the GPU, with a 1e-6
relative tolerance instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`

import pytest
import torch

from moe_kernels.bf16x2_layout import Bf16x2Weights, to_bf16x2
from moe_kernels.grouped_gemm import grouped_swiglu, grouped_swiglu_w4a4, mxfp4_linear
from moe_kernels.kernel_configs import KernelConfig
from moe_kernels.mxfp4 import MXFP4Tensor, quantize
from tests.support import triton_interpreter
from tests.support.tools import missing

if TYPE_CHECKING:
    from services.model.experts import ExpertBank

try:
    import triton  # noqa: F401
except ImportError:
    missing("triton", "pip install -e .[test]")

from moe_kernels.triton_mxfp4 import (
    grouped_mxfp4_gemm,
    grouped_swiglu_w4a4_triton,
)

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"
INNERS = ["dot_scaled", "decode", "f16", "f16x2", "bf16x2", "bf16"]


@pytest.fixture(autouse=True, scope="module")
def _interpreter_taught() -> Iterator[None]:
    """The interpreter runs inline PTX (bf16x2's, as written) and bfloat16 dots."""
    with triton_interpreter.taught() if INTERPRET else contextlib.nullcontext():
        yield


# Small tiles so that tiny shapes still span several tiles and hit every mask.
SMALL = {"block_n": 16, "block_m": 32, "block_k": 64}


def small(inner: str) -> dict[str, int]:
    """SMALL tiles; "f16" steps K by 32 (one scale block, its least), the others by 64."""
    return {**SMALL, "block_k": 32} if inner == "f16" else SMALL


def weights(w: MXFP4Tensor, inner: str) -> MXFP4Tensor | Bf16x2Weights:
    """w in the layout `inner` reads."""
    return to_bf16x2(w) if inner == "bf16x2" else w


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    actual, expected = actual.cpu(), expected.cpu()
    if INTERPRET:
        assert torch.equal(actual.isnan(), expected.isnan())
        finite = ~expected.isnan()
        # bit for bit, the sign of zero included
        assert torch.equal(actual[finite].view(torch.int32), expected[finite].view(torch.int32))
    else:
        scale = expected[~expected.isnan()].abs().max().item()  # NaN rows are compared too
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * scale,
                                   equal_nan=True)


def offsets_of(tokens_per_expert: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(tokens_per_expert).cumsum(0).tolist()])


def make(tokens_per_expert: list[int], k: int, m: int, seed: int = 0) -> tuple[MXFP4Tensor,
                                                                               MXFP4Tensor]:
    """x: MXFP4 of [N, K] activations; w: MXFP4 of [E, M, K] weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(tokens_per_expert), k, generator=g)
    w = torch.randn(len(tokens_per_expert), m, k, generator=g) / k**0.5
    qx, qw = quantize(x), quantize(w)
    return (MXFP4Tensor(qx.packed.to(DEVICE), qx.scales.to(DEVICE)),
            MXFP4Tensor(qw.packed.to(DEVICE), qw.scales.to(DEVICE)))


def reference_gemm(x: MXFP4Tensor, tokens_per_expert: list[int], w: MXFP4Tensor) -> torch.Tensor:
    """The torch path: `mxfp4_linear` on each expert's rows."""
    out = torch.full((x.shape[0], w.shape[1]), float("nan"), device=DEVICE)
    start = 0
    for expert, count in enumerate(tokens_per_expert):
        if count:
            out[start:start + count] = mxfp4_linear(x[start:start + count], w[expert])
            start += count
    return out


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("swap_ab", [False, True], ids=["x_w", "w_x"])
@pytest.mark.parametrize("dense", [False, True], ids=["schedule", "dense"])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize(("tokens_per_expert", "k", "m"), [
    ([0, 5, 17, 0, 3, 0], 64, 48),  # uneven; empty first, middle and last; 17 rows = 2 tiles
    ([1], 32, 40),  # a single token
    ([0, 0, 1, 0], 96, 24),  # a single token among empty experts; K = 1.5 K-steps
    ([2, 0, 3], 256, 16),  # 4 K-steps: split 3 -> 2 of 2 (f16: 8 steps, 3 + 3 + 2)
    ([3, 1], 224, 16),  # 3.5 K-steps: split 3 -> 2 + 1.5 (f16: 7 steps, 3 + 3 + 1)
])
def test_gemm_matches_mxfp4_linear_per_expert(tokens_per_expert: list[int], k: int, m: int,
                                              inner: str, swap_ab: bool, dense: bool,
                                              split_k: int) -> None:
    """Every inner product, both operand orders, both row-tile grids (the device-built
    schedule, and E x cdiv(max rows, block_n) tiles when the caller knows the max), and K
    split over programs (as many as there are K steps, at most)."""
    x, w = make(tokens_per_expert, k, m)
    out = grouped_mxfp4_gemm(x, offsets_of(tokens_per_expert), weights(w, inner), inner=inner,
                             swap_ab=swap_ab, max_rows=max(tokens_per_expert) if dense else None,
                             split_k=split_k, **small(inner))
    assert_same(out, reference_gemm(x, tokens_per_expert, w))


def test_gemm_default_tiles_strided_rows_and_int32_offsets() -> None:
    tokens = [3, 0, 40, 2]
    x, w = make(tokens, 96, 72, seed=1)
    rows = MXFP4Tensor.from_rows(x.to_rows(), 96)  # packed/scales are views, row stride 51
    assert not rows.packed.is_contiguous()
    out = grouped_mxfp4_gemm(rows, offsets_of(tokens).int().to(DEVICE), w)
    assert_same(out, reference_gemm(x, tokens, w))


@pytest.mark.parametrize("inner", INNERS)
def test_gemm_nan_block_poisons_its_row_only(inner: str) -> None:
    tokens = [2, 3]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=g)
    x[3, 40] = float("inf")  # block 1 of row 3 gets the NaN scale 0xFF
    qx, (_, w) = quantize(x), make(tokens, 64, 16)
    qx = MXFP4Tensor(qx.packed.to(DEVICE), qx.scales.to(DEVICE))
    assert qx.scales[3, 1].item() == 0xFF
    out = grouped_mxfp4_gemm(qx, offsets_of(tokens), weights(w, inner), inner=inner,
                             **small(inner))
    assert out[3].isnan().all() and not out[[0, 1, 2, 4]].isnan().any()
    assert_same(out, reference_gemm(qx, tokens, w))


@pytest.mark.parametrize(("tokens_per_expert", "hidden", "inter"), [
    ([0, 7, 1, 0, 20, 0], 32, 64),  # uneven, empty first and last; M = H = 32 < block_m 64
    ([4, 0, 9], 64, 32),
    ([0, 5, 0, 2], 96, 96),  # M = H = 96 and 2I = 192: partial and exact m-tiles
    ([1], 64, 64),  # a single token
    ([0, 1, 0], 96, 32),  # a single token among empty experts
    ([3, 0, 12, 40, 0, 1, 70, 0], 256, 128),  # larger: several K steps, m-tiles, row tiles
])
def test_swiglu_matches_torch_path(tokens_per_expert: list[int], hidden: int,
                                   inter: int) -> None:
    x, w_gate_up = make(tokens_per_expert, hidden, 2 * inter, seed=hidden + inter)
    _, w_down = make(tokens_per_expert, inter, hidden, seed=hidden * inter)
    out = grouped_swiglu_w4a4_triton(x, tokens_per_expert, w_gate_up, w_down)
    assert out.device.type == DEVICE
    expected = grouped_swiglu_w4a4(x, tokens_per_expert, w_gate_up, w_down)
    assert_same(out, expected.to(out.device))


@pytest.mark.parametrize("config", [
    KernelConfig(inner="f16x2", swap_ab=True, block_n=16, block_m=32, block_k=64, split_k=2),
    KernelConfig(inner="f16", block_n=32, block_m=64, block_k=32, num_stages=5),
    KernelConfig(inner="bf16x2", swap_ab=True, block_n=16, block_m=64, block_k=128),
], ids=["f16x2", "f16", "bf16x2"])
def test_swiglu_runs_a_given_kernel_config(config: KernelConfig) -> None:
    """A tuned config (`moe_kernels.kernel_configs`) serves both GEMMs of the FFN, the
    weights converted to its layout if they are not in it."""
    tokens = [3, 0, 12, 40, 0, 1, 70, 0]
    x, w_gate_up = make(tokens, 128, 256, seed=5)  # K of 2 blocks of 64, of 4 of 32
    _, w_down = make(tokens, 128, 128, seed=6)
    want = grouped_swiglu_w4a4(x, tokens, w_gate_up, w_down).to(DEVICE)
    assert_same(grouped_swiglu_w4a4_triton(x, tokens, w_gate_up, w_down, config), want)
    layout = (weights(w_gate_up, config.inner), weights(w_down, config.inner))
    assert_same(grouped_swiglu_w4a4_triton(x, tokens, *layout, config), want)


def test_weights_in_another_kernels_layout_are_an_error() -> None:
    x, w = make([2], 64, 32)
    with pytest.raises(ValueError, match="the bf16x2 inner product takes weights in the "
                                         "bf16x2 layout; got MXFP4Tensor"):
        grouped_mxfp4_gemm(x, offsets_of([2]), w, inner="bf16x2")
    with pytest.raises(ValueError, match="the dot_scaled inner product takes weights as "
                                         "MXFP4Tensor; got Bf16x2Weights"):
        grouped_mxfp4_gemm(x, offsets_of([2]), to_bf16x2(w))
    with pytest.raises(ValueError, match="reads MXFP4Tensor weights, not the bf16x2 layout"):
        grouped_swiglu_w4a4_triton(x, [2], to_bf16x2(w), w, KernelConfig(inner="f16"))
    with pytest.raises(ValueError, match="converting them synchronises: convert first"):
        grouped_swiglu_w4a4_triton(x, torch.tensor([2], device=DEVICE), w, w,
                                   KernelConfig(inner="bf16x2", swap_ab=True), max_rows=2)


def test_the_bf16_route_is_a_config_too() -> None:
    """route "bf16_grouped_mm": operands decoded to bf16, `torch._grouped_mm`, host or
    device counts."""
    from moe_kernels.triton_mxfp4 import grouped_swiglu_w4a4_bf16

    tokens = [3, 0, 12, 1]
    x, w_gate_up = make(tokens, 64, 64, seed=9)
    _, w_down = make(tokens, 32, 64, seed=10)
    want = grouped_swiglu_w4a4_bf16(x, tokens, w_gate_up, w_down)
    route = KernelConfig(route="bf16_grouped_mm")
    for counts in (tokens, torch.tensor(tokens, device=DEVICE)):
        got = grouped_swiglu_w4a4_triton(x, counts, w_gate_up, w_down, route, max_rows=12)
        assert torch.equal(got, want)


def test_swiglu_on_device_counts_equals_host_counts() -> None:
    """Counts as a device tensor with a bound instead of a list (no host sync: CUDA graphs)."""
    tokens = [3, 0, 12, 40, 0, 1, 70, 0]
    x, w_gate_up = make(tokens, 256, 256, seed=7)
    _, w_down = make(tokens, 128, 256, seed=8)
    counts = torch.tensor(tokens, device=DEVICE)
    want = grouped_swiglu_w4a4_triton(x, tokens, w_gate_up, w_down)
    assert_same(grouped_swiglu_w4a4_triton(x, counts, w_gate_up, w_down, max_rows=70), want)
    assert_same(grouped_swiglu_w4a4_triton(x, counts, w_gate_up, w_down, max_rows=134), want)
    with pytest.raises(ValueError, match="counts on the device need max_rows"):
        grouped_swiglu_w4a4_triton(x, counts, w_gate_up, w_down)


def test_k_not_a_multiple_of_32_raises() -> None:
    x = MXFP4Tensor(torch.zeros(3, 24, dtype=torch.uint8), torch.zeros(3, 1, dtype=torch.uint8))
    w = MXFP4Tensor(torch.zeros(2, 8, 24, dtype=torch.uint8),
                    torch.zeros(2, 8, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32; got 48"):
        grouped_mxfp4_gemm(x, offsets_of([1, 2]), w)
    with pytest.raises(ValueError, match="multiple of 32; got 48"):
        grouped_swiglu_w4a4_triton(x, [1, 2], w, w)


def test_bad_tokens_per_expert_raises() -> None:
    x, w = make([2, 2], 32, 64)
    with pytest.raises(ValueError, match="sum to 4"):
        grouped_swiglu_w4a4_triton(x, [1, 2], w, w)


@pytest.mark.parametrize("inner", ["f16", "f16x2"])
@pytest.mark.parametrize("block_k", [32, 64, 128])
def test_float16_codes_step_any_number_of_scale_blocks(inner: str, block_k: int) -> None:
    """One MMA per 32-block, block_k / 32 of them per K step; K = 224 leaves a partial step
    (whole blocks masked) for block_k 64 and 128."""
    tokens = [3, 0, 17, 1]
    x, w = make(tokens, 224, 40, seed=3)
    for swap_ab in (False, True):
        out = grouped_mxfp4_gemm(x, offsets_of(tokens), w, inner=inner, swap_ab=swap_ab,
                                 block_n=16, block_m=32, block_k=block_k, max_rows=17)
        assert_same(out, reference_gemm(x, tokens, w))


def test_f16x2_reads_unaligned_rows() -> None:
    """Weight codes are read as 32-bit words, which needs 4-byte aligned rows: others are
    copied first. Token rows (read by bytes) may be any view."""
    tokens = [3, 0, 40, 2]
    x, w = make(tokens, 96, 72, seed=1)
    rows = MXFP4Tensor.from_rows(x.to_rows(), 96)  # token rows 51 bytes apart
    wide = torch.zeros(*w.packed.shape[:-1], 49, dtype=torch.uint8, device=DEVICE)
    wide[..., :48] = w.packed
    odd = MXFP4Tensor(wide[..., :48], w.scales)  # weight rows 49 bytes apart
    assert rows.packed.stride(0) % 4 and odd.packed.stride(1) % 4
    for swap_ab in (False, True):
        out = grouped_mxfp4_gemm(rows, offsets_of(tokens), odd, inner="f16x2",
                                 swap_ab=swap_ab)
        assert_same(out, reference_gemm(x, tokens, w))


def test_bad_block_k_and_inner_product_say_so() -> None:
    x, w = make([2], 64, 32)
    with pytest.raises(ValueError, match="a power of two, at least 32 for the f16 inner "
                                         "product; got 96"):
        grouped_mxfp4_gemm(x, offsets_of([2]), w, inner="f16", block_k=96)
    with pytest.raises(ValueError, match="at least 64 for the dot_scaled inner product; "
                                         "got 32"):
        grouped_mxfp4_gemm(x, offsets_of([2]), w, block_k=32)
    with pytest.raises(ValueError, match="unknown inner product 'fp8'"):
        grouped_mxfp4_gemm(x, offsets_of([2]), w, inner="fp8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_kernel_equals_the_torch_decode(dtype: torch.dtype) -> None:
    """Every code and scale byte (0 is 2**-127, 0xFF is NaN), K = 96 (a partial K block),
    rows as strided views, weights as [E, M, K]."""
    from moe_kernels.mxfp4 import dequantize
    from moe_kernels.triton_mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (2, 19, 48), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (2, 19, 3), dtype=torch.uint8, generator=g)
    scales[0, 0] = torch.tensor([0, 255, 127], dtype=torch.uint8)
    w = MXFP4Tensor(packed.to(DEVICE), scales.to(DEVICE))
    rows = MXFP4Tensor.from_rows(MXFP4Tensor(packed[0], scales[0]).to_rows().to(DEVICE), 96)
    for q in (w, rows):
        got, want = dequantize_mxfp4(q, dtype), dequantize(q, dtype)
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.equal(got.isnan(), want.isnan())
        got, want = got.nan_to_num(), want.nan_to_num()
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_w4a4_through_bf16_grouped_gemms_is_as_close_to_float_as_the_torch_path() -> None:
    """Exact operands, bfloat16-rounded GEMM outputs: a re-quantized code flips now and
    then between the GEMMs, so this route is compared with the float FFN of the same
    operands, as the torch path is (measured: 0.135-0.148 relative for both, 0.007-0.037
    between them, over 5 seeds)."""
    from moe_kernels.mxfp4 import dequantize
    from moe_kernels.triton_mxfp4 import grouped_swiglu_w4a4_bf16

    tokens = [3, 0, 12, 5]
    x, w_gate_up = make(tokens, 128, 2 * 64, seed=5)
    _, w_down = make(tokens, 64, 128, seed=6)
    got = grouped_swiglu_w4a4_bf16(x, tokens, w_gate_up, w_down).cpu()
    torch_path = grouped_swiglu_w4a4(x, tokens, w_gate_up, w_down).cpu()
    ffn = grouped_swiglu(dequantize(x), tokens, dequantize(w_gate_up),
                         dequantize(w_down)).cpu()  # float, no re-quantization

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    assert got.dtype == torch.float32 and got.shape == ffn.shape
    assert rel(got, ffn) <= 1.05 * rel(torch_path, ffn)
    assert rel(got, torch_path) < 0.05


def test_every_variant_compiles_for_hopper_and_blackwell() -> None:
    """The compiler, not the interpreter: each inner product and operand order to a cubin
    for sm_90 (the default and bf16x2 for sm_100 too, bf16x2 for sm_80), and the decode
    and quantize kernels, in a process without TRITON_INTERPRET."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "tests.support.compile_kernels"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(": ok (") == 28, out.stdout


@pytest.mark.parametrize("fault", ["wrong by 0.1%", "fails to compile split over K"])
def test_the_gpu_benchmarks_check_runs_on_this_device(monkeypatch: pytest.MonkeyPatch,
                                                      fault: str) -> None:
    """benchmarks/gpu_mxfp4.py's `check` (what gpu_check runs first; only the variants it
    passes are swept and tuned in), here: right variants (one reading its own weight
    layout) and the bf16 route pass, and a faulty variant is dropped, alone."""
    from benchmarks import gpu_mxfp4
    from benchmarks.gpu_mxfp4 import ROUTE, check, check_quantize, parse_args
    from moe_kernels import triton_mxfp4

    monkeypatch.setattr(gpu_mxfp4, "UNEVEN", (128, 64, gpu_mxfp4.UNEVEN[2]))  # interpreted

    real = triton_mxfp4.grouped_mxfp4_gemm

    def f16x2_off(*args: object, **kw: object) -> torch.Tensor:
        out = real(*args, **kw)  # type: ignore[arg-type]
        if kw.get("inner") != "f16x2":
            return out
        if fault == "wrong by 0.1%":
            return out * 1.001
        if kw.get("split_k", 1) > 1:  # after its first run passed
            raise RuntimeError("PassManager::run failed")
        return out

    monkeypatch.setattr(triton_mxfp4, "grouped_mxfp4_gemm", f16x2_off)
    args = parse_args(["--hidden", "64", "--inter", "32"])
    ok, working = check(args, ["dot_scaled", "f16x2/swap", "bf16x2/swap"], device=DEVICE)
    assert not ok and working == ["dot_scaled", "bf16x2/swap", ROUTE]
    assert check_quantize(DEVICE)  # its part of `ok`, which the wrong variant made False


@pytest.fixture(scope="module")
def w4a4_bank_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support import checkpoints

    path = tmp_path_factory.mktemp("bank")
    checkpoints.build(checkpoints.qwen3_moe_config(moe_intermediate_size=96), path, seed=3)
    return path


class BankRig:
    """An `ExpertBank` whose Triton path, its CUDA path, runs here (in the interpreter on
    a CPU): `table` stands for its GPU's tuned table, and `conversions` counts
    `to_bf16x2` calls."""

    def __init__(self, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from moe_kernels import selection
        from services.model import experts

        self.experts, self.selection, self.path, self.conversions = experts, selection, path, 0
        self.monkeypatch = monkeypatch
        self.table: dict[int, KernelConfig] = {}
        real = selection.to_bf16x2

        def counted(w: MXFP4Tensor) -> Bf16x2Weights:
            self.conversions += 1
            return real(w)

        monkeypatch.setattr(selection, "to_bf16x2", counted)
        monkeypatch.setattr(selection, "load_configs", lambda gpu: self.table)
        monkeypatch.setattr(selection, "tuned_config", lambda gpu, rows: self.pick(rows))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def pick(self, rows: int) -> KernelConfig:
        return min(self.table.items(), key=lambda item: abs(item[0] - rows))[1]

    def bank(self, gpu: str | None = "Test GPU") -> ExpertBank:
        from services.model.checkpoint import Checkpoint
        from services.model.config import ModelConfig

        cfg = ModelConfig.from_dir(self.path)
        self.monkeypatch.setattr(self.selection, "gpu_name", lambda device: gpu)
        return self.experts.ExpertBank(cfg, Checkpoint(self.path),
                                       self.experts.all_experts(cfg), torch.float32, "w4a4",
                                       device=DEVICE)

    def run(self, bank: ExpertBank, tokens: list[int]) -> None:
        """Every layer on the Triton path, against the torch path."""
        x = quantize(torch.randn(sum(tokens), bank.hidden_size,
                                 generator=torch.Generator().manual_seed(len(tokens)))
                     .to(DEVICE))
        for layer in bank.w_gate_up:
            want = grouped_swiglu_w4a4(x, tokens, bank.w_gate_up[layer], bank.w_down[layer])
            assert_same(bank._triton_w4a4(layer, x, tokens, []), want)


BF16X2 = KernelConfig(inner="bf16x2", swap_ab=True, block_n=16, block_m=32, block_k=64)
DECODE_TILES = KernelConfig(inner="decode", block_n=16, block_m=32, block_k=64)
DECODE = [1, 0, 2, 1, 0, 0, 1, 1]  # tokens per expert: 1 or 2, the table's key 2
PREFILL = [40, 3, 0, 33, 25, 0, 7, 12]  # the most 40, the key 40


def test_bank_converts_at_load_when_its_table_has_bf16x2_and_never_again(
        w4a4_bank_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A table with bf16x2 for decode and another variant for prefill, prefill first (as
    serving goes): the weights are converted once, at load, and both configs run."""
    rig = BankRig(w4a4_bank_ckpt, monkeypatch)
    rig.table = {2: BF16X2, 40: DECODE_TILES}
    bank = rig.bank()
    layers = len(bank.w_gate_up)
    assert rig.conversions == 2 * layers and set(bank.kernels.bf16x2) == set(bank.w_gate_up)
    before = sum(w.packed.numel() + w.scales.numel() for w in
                 [*bank.w_gate_up.values(), *bank.w_down.values()])
    assert bank.nbytes() == 2 * before  # the layout is a second copy
    rig.run(bank, PREFILL)
    rig.run(bank, DECODE)
    assert bank.kernels.runs == {DECODE_TILES: True, BF16X2: True}
    assert rig.conversions == 2 * layers and bank.kernels.bf16x2


def test_bank_without_a_table_entry_converts_on_first_use(
        w4a4_bank_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = BankRig(w4a4_bank_ckpt, monkeypatch)
    bank = rig.bank()  # the table is empty at load
    assert rig.conversions == 0
    rig.table = {2: BF16X2}
    rig.run(bank, DECODE)
    rig.run(bank, DECODE)
    assert rig.conversions == 2 * len(bank.w_gate_up) and bank.kernels.runs == {BF16X2: True}


def test_weights_the_layout_cannot_scale_fall_back_for_good(
        w4a4_bank_ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One block scaled by 2**2, the least the layout cannot scale (valid MXFP4): no copy,
    the fallback kernel, same results, and no second try for the table's other bf16x2
    config. (Not a far larger scale: beside such a block, the float32 sums of the two paths
    round differently in their own orders, so neither is "the" result to compare bits.)"""
    from moe_kernels.bf16x2_layout import MAX_SCALE

    rig = BankRig(w4a4_bank_ckpt, monkeypatch)
    bank = rig.bank()
    bank.w_down[max(bank.w_down)].scales[0, 0, 0] = MAX_SCALE + 1
    other = KernelConfig(inner="bf16x2", swap_ab=True, block_n=16, block_m=64, block_k=32)
    rig.table = {2: BF16X2, 40: other}
    rig.run(bank, DECODE)
    rig.run(bank, PREFILL)
    assert bank.kernels.bf16x2 is None and bank.kernels.runs == {BF16X2: False, other: False}
    assert rig.conversions <= 2 * len(bank.w_gate_up)  # the one attempt, stopped at the raise


def test_a_copy_no_runnable_config_reads_is_freed(w4a4_bank_ckpt: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Converted at load for a bf16x2 config that then fails to run (a compiler error):
    once the table's every bf16x2 config has failed, the copy goes."""
    from moe_kernels import triton_mxfp4

    real = triton_mxfp4.grouped_swiglu_w4a4_triton

    def no_bf16x2(*args: object, **kw: object) -> torch.Tensor:
        config = args[4] if len(args) > 4 else kw.get("config")
        if isinstance(config, KernelConfig) and config.inner == "bf16x2":
            raise RuntimeError("PassManager::run failed")  # as a Triton compile error
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_mxfp4, "grouped_swiglu_w4a4_triton", no_bf16x2)
    rig = BankRig(w4a4_bank_ckpt, monkeypatch)
    rig.table = {2: BF16X2, 40: DECODE_TILES}
    bank = rig.bank()
    rig.run(bank, PREFILL)
    assert bank.kernels.bf16x2  # the bf16x2 config is untried: kept
    rig.run(bank, DECODE)
    assert bank.kernels.runs == {DECODE_TILES: True, BF16X2: False} and bank.kernels.bf16x2 == {}
    assert bank.nbytes() == sum(w.packed.numel() + w.scales.numel() for w in
                                [*bank.w_gate_up.values(), *bank.w_down.values()])


def test_quantize_kernel_equals_the_torch_quantizer() -> None:
    """`quantize_mxfp4` (one kernel; what CUDA runs via `quantize_fused`) against
    `moe_kernels.mxfp4.quantize` (checked against the OCP MX spec, test_mxfp4.py), byte
    for byte: magnitudes from float32 denormals to 2**120, zero, -0.0, NaN and inf blocks,
    every rounding tie, saturation; float32, bfloat16 (its denormals too) and float16
    inputs; rows as strided views; leading dimensions; no rows."""
    from moe_kernels.triton_mxfp4 import quantize_mxfp4

    g = torch.Generator().manual_seed(11)
    x = torch.randn(41, 224, generator=g) * torch.exp2(
        torch.randint(-150, 120, (41, 1), generator=g).float())  # [41, 224], 7 blocks a row
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.1, 2.75, 4.5,
                         0.5, 1.0, 3.0, 5.5] * 2)
    x[0, :32], x[1, :32], x[1, 32:64] = 0.0, -0.0, -ties * 2.0**-130  # zeros; denormal ties
    x[2, 5], x[3, 40], x[4, 100] = float("nan"), float("inf"), -float("inf")
    x[5, :32], x[6, :32] = ties * 4, -ties * 2.0**100
    cases = {"float32": x, "bfloat16": x.bfloat16(), "float16": x.clamp(-6e4, 6e4).half(),
             "strided rows": x[:, :96], "leading dims": x[:40].reshape(4, 10, 224),
             "no rows": x[:0]}
    for name, t in cases.items():
        want, got = quantize(t), quantize_mxfp4(t.to(DEVICE))
        assert got.shape == want.shape, name
        assert torch.equal(got.packed.cpu(), want.packed), name
        assert torch.equal(got.scales.cpu(), want.scales), name
    assert quantize(x).scales[2:5].eq(0xFF).sum() == 3  # the special blocks are there


def test_the_gpu_benchmarks_bench_and_sweep_run_their_plumbing_here(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """gpu_check's timing sections (`bench`, `sweep`) on tiny shapes here, with a stand-in
    clock: every swept config of a bf16x2 and a tl.dot_scaled variant runs (the sweep
    turns exceptions into rows, so each must be a timing), the best per shape becomes a
    table, and `bench` runs a tuned bf16x2 entry from such a table. What a GPU run times
    is its own; this is what it would trip over first."""
    from benchmarks import gpu_mxfp4
    from moe_kernels import kernel_configs

    clock = iter(range(1, 10**6))
    monkeypatch.setattr(gpu_mxfp4, "time_ms", lambda fn, warmup, iters, flush: (
        fn(), next(clock) * 1e-3)[1])
    variants = ["dot_scaled", "bf16x2/swap"]
    results = gpu_mxfp4.sweep(variants, 1e12, None, experts=2, hidden=64, inter=32,
                              tokens=(1,), device=DEVICE)
    tried = sum(len(gpu_mxfp4.sweep_configs(v, 1)) for v in variants)
    assert len(results) == 2 * tried, capsys.readouterr().out  # both GEMMs, no failures
    assert "WRONG" not in capsys.readouterr().out
    best = gpu_mxfp4.best_configs(results)
    assert best[1] == KernelConfig(inner="dot_scaled", block_n=16, block_m=128, block_k=128,
                                   split_k=1)  # the first timed: least by the clock
    table = {1: KernelConfig(inner="bf16x2", swap_ab=True, block_n=16, block_m=32,
                             block_k=32)}
    monkeypatch.setattr(kernel_configs, "load_configs", lambda name: table)
    args = gpu_mxfp4.parse_args(["--experts", "2", "--hidden", "64", "--inter", "32",
                                 "--decode", "1", "--prefill", "4"])
    gpu_mxfp4.bench(args, ["bf16x2/swap"], 1e12, device=DEVICE)
    out = capsys.readouterr().out
    # 2 GEMMs x 2 token counts (the table's one entry is the nearest for both)
    assert out.count("| tuned: bf16x2/swap (16, 32, 32, 4, 3, 1) |") == 4
    assert out.count("| triton bf16x2/swap |") == 4


def test_the_gpu_sweep_never_times_a_config_whose_output_is_wrong(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`check` ran each variant at its default tiles only; the sweep compares every config
    it tries with the torch path first, so a fast wrong tile never enters a tuned table."""
    from benchmarks import gpu_mxfp4
    from moe_kernels import triton_mxfp4

    real = triton_mxfp4.grouped_mxfp4_gemm

    def wide_tiles_off(*args: object, **kw: object) -> torch.Tensor:
        out = real(*args, **kw)  # type: ignore[arg-type]
        return out * 1.001 if kw.get("block_m") == 256 else out

    monkeypatch.setattr(triton_mxfp4, "grouped_mxfp4_gemm", wide_tiles_off)
    monkeypatch.setattr(gpu_mxfp4, "time_ms", lambda fn, warmup, iters, flush: 1e-3)
    results = gpu_mxfp4.sweep(["bf16x2/swap"], 1e12, None, experts=2, hidden=64, inter=32,
                              tokens=(1,), device=DEVICE)
    configs = gpu_mxfp4.sweep_configs("bf16x2/swap", 1)
    wide = sum(c[1] == 256 for c in configs)
    assert 0 < wide < len(configs)
    assert len(results) == 2 * (len(configs) - wide)  # both GEMMs
    assert all(r["config"][1] != 256 for r in results)
    assert capsys.readouterr().out.count("| WRONG: max rel err 1.00e-03 vs the torch path") \
        == 2 * wide


def test_the_gpu_preflight_runs_every_kernel_here() -> None:
    """What gpu_check's preflight child runs, kernel by kernel (here in the interpreter):
    each must run, or the child would report a working kernel as failed."""
    from benchmarks.gpu_preflight import KERNELS, run

    for name in KERNELS:
        run(name, DEVICE)
