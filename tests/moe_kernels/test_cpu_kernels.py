"""The compiled CPU kernels for float32 (`moe_kernels/csrc/f32_cpu.cpp`) over weights in
panels (`moe_kernels.panels`), against torch: the grouped SwiGLU against the torch path
(`grouped_swiglu`, expert by expert through torch's matmuls) with uneven, empty and
prefill-sized experts, each expert timed on its own; the linear against `F.linear` for any
rows, remainders of every register tile, strided x; bad input refused; and the torch path
where the kernels are off or cannot be built."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe_kernels import cpu_kernels
from moe_kernels.grouped_gemm import grouped_swiglu
from moe_kernels.int8 import int8_panels, reference_linear
from moe_kernels.panels import PanelWeights, plain, to_panels
from moe_kernels.selection import cpu_grouped_swiglu, linear, panels_for_cpu
from tests.support.kernels import assert_expert_spans

pytestmark = pytest.mark.timeout(300)


def weights(experts: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5,
            torch.randn(experts, hidden, inter, generator=g) / inter**0.5)


def test_panels_are_the_same_weight_reordered() -> None:
    w = torch.randn(3, 48, 20)
    p = to_panels(w)
    assert p.panels.shape == (3, 3, 20, 16) and p.shape == (3, 48, 20)
    assert p.panels[1, 2, 5, 7] == w[1, 2 * 16 + 7, 5]  # panel 2, k 5, column 7 of it
    assert torch.equal(p.unpack(), w) and torch.equal(plain(p), w) and plain(w) is w
    with pytest.raises(ValueError, match="multiple of 16"):
        to_panels(torch.randn(40, 8))


@pytest.mark.parametrize(("counts", "hidden", "inter"), [
    ([1], 64, 48),  # a decode of one token; I of 3 panels: a partial panel group
    ([0, 1, 3, 0, 2, 4, 0, 1], 64, 48),  # uneven, with empty experts
    ([5, 47, 48, 49, 0, 100], 128, 32),  # either side of a task's 48-row chunk, and a prefill
    ([0, 0, 0], 64, 16),  # no rows at all
    ([2, 7, 1, 9], 1024, 768),  # the benchmarks' mid-size shapes
])
def test_the_kernel_equals_the_torch_path(kernel: object, counts: list[int], hidden: int,
                                          inter: int) -> None:
    w_gate_up, w_down = weights(len(counts), hidden, inter, seed=sum(counts))
    x = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(1))
    want = grouped_swiglu(x, counts, w_gate_up, w_down)
    spans: list[tuple[int, int]] = []
    got = cpu_grouped_swiglu(x, counts, to_panels(w_gate_up), to_panels(w_down), spans)
    assert got is not None and got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32: summation order
    assert_expert_spans(spans, counts)


def test_bad_input_is_refused_with_its_reason(kernel: object) -> None:
    w_gate_up, w_down = weights(2, 64, 16, seed=0)
    gu, d = to_panels(w_gate_up).panels, to_panels(w_down).panels
    x = torch.randn(3, 64)
    for counts, reason in [([1, 1], "do not sum to the rows"), ([4, -1], "negative count"),
                           ([3], "one count per local expert")]:
        with pytest.raises(RuntimeError, match=reason):
            kernel.grouped_swiglu_f32(x, counts, gu, d)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="float32"):
        kernel.grouped_swiglu_f32(x.double(), [1, 2], gu, d)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="panels"):
        kernel.grouped_swiglu_f32(x, [1, 2], w_gate_up, w_down)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="do not match"):
        kernel.grouped_swiglu_f32(x, [1, 2], d, gu)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="differ in K"):
        kernel.linear_f32(torch.randn(2, 32), gu[0])  # type: ignore[attr-defined]


def test_where_it_does_not_apply_the_torch_path_runs(kernel: object) -> None:
    w_gate_up, w_down = weights(2, 64, 16, seed=0)
    x = torch.randn(3, 64)
    assert cpu_grouped_swiglu(x, [1, 2], w_gate_up, w_down, None) is None  # not in panels
    assert cpu_grouped_swiglu(x.double(), [1, 2], to_panels(w_gate_up), to_panels(w_down),
                              None) is None
    odd = torch.randn(40, 64)  # N not a multiple of 16: stays as it is, for torch's matmul
    assert panels_for_cpu(odd) is odd and isinstance(panels_for_cpu(w_down), PanelWeights)
    assert panels_for_cpu(w_down.double()).dtype == torch.float64
    torch.testing.assert_close(linear(x, odd), F.linear(x, odd))


@pytest.mark.parametrize("m", [0, 1, 2, 5, 6, 7, 16, 48, 49, 100])
@pytest.mark.parametrize(("n", "k"), [(16, 7), (1008, 1024), (48, 33), (80, 48)])
def test_the_linear_equals_torchs(kernel: object, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k**0.5
    panels = panels_for_cpu(w)
    assert isinstance(panels, PanelWeights)
    got = linear(x, panels)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    wide = torch.randn(m, 2 * k, generator=g)[:, :k]  # a strided view of x
    torch.testing.assert_close(linear(wide, panels), F.linear(wide, w), rtol=1e-5, atol=1e-5)


def test_panels_run_on_torch_once_the_kernels_are_off(kernel: object) -> None:
    w = torch.randn(32, 64)
    x = torch.randn(3, 64)
    cpu_kernels.set_enabled(False)
    try:
        torch.testing.assert_close(linear(x, to_panels(w)), F.linear(x, w))
    finally:
        cpu_kernels.set_enabled(True)


def test_a_machine_that_cannot_build_it_says_so_once(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture,
                                                     tmp_path: Path) -> None:
    import torch.utils.cpp_extension as cpp

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp, "load", no_compiler)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # no build in its cache
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setattr(cpu_kernels, "_built", None)
    monkeypatch.setattr(cpu_kernels, "_failed", False)
    caplog.set_level(logging.INFO, logger="switchyard.expert")
    w_gate_up, w_down = weights(1, 64, 16, seed=0)
    for _ in range(3):
        gu, d = panels_for_cpu(w_gate_up), panels_for_cpu(w_down)
        assert gu is w_gate_up and d is w_down  # torch's layout, for torch's matmuls
        assert cpu_grouped_swiglu(torch.randn(2, 64), [2], gu, d, None) is None
        # int8 dense weights: the scheme's own sums in torch (`int8.reference_linear`)
        packed, x = int8_panels(torch.randn(20, 40)), torch.randn(3, 40)
        torch.testing.assert_close(linear(x, packed), reference_linear(x, packed))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not be built" in warnings[0] and \
        "Ninja is required" in warnings[0] and "torch's matmuls" in warnings[0], warnings


def test_a_build_in_the_cache_is_imported_without_building(kernel: object) -> None:
    """Another process (as another venv with the same torch would) finds the `kernel`
    fixture's build by its name and imports it: no compiler, no ninja."""
    out = subprocess.run([sys.executable, "-c", (
        "from moe_kernels import cpu_kernels as k; import torch.utils.cpp_extension as c\n"
        "c.load = None  # any build would raise\n"
        "print(k.cpu_kernels().__file__)")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == getattr(kernel, "__file__", None)


def test_a_prebuilt_folder_is_looked_in_first(kernel: object, tmp_path: Path) -> None:
    """An image's kernels, built beforehand into `SWITCHYARD_CPU_KERNELS_PREBUILT`, are
    imported from there while the extension cache (compose's volume) is empty."""
    built = Path(getattr(kernel, "__file__", ""))
    prebuilt = tmp_path / "prebuilt" / built.parent.name
    prebuilt.mkdir(parents=True)
    (prebuilt / built.name).write_bytes(built.read_bytes())
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty"),
           "SWITCHYARD_CPU_KERNELS_PREBUILT": str(tmp_path / "prebuilt")}
    program = ("from moe_kernels import cpu_kernels as k; import torch.utils.cpp_extension as c\n"
               "c.load = None  # any build would raise\n"
               "print(k.cpu_kernels() and k.cpu_kernels().__file__)")
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr  # not `ready`:
    assert "could not be built" in out.stderr  # so it tried to build, and could not
    (prebuilt / "ready").touch()
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(prebuilt / built.name)


def test_switched_off_it_is_never_built() -> None:
    out = subprocess.run([sys.executable, "-c", (
        "from moe_kernels import cpu_kernels as k; import torch.utils.cpp_extension as c\n"
        "c.load = None  # any build would raise\n"
        "assert k.cpu_kernels() is None and k.cpu_kernels() is None; print('off')")],
        env={"SWITCHYARD_CPU_KERNELS": "0", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "off", out.stderr


@pytest.mark.parametrize(("tokens", "experts", "top_k", "normalize"),
                         [(1, 8, 2, True), (7, 64, 4, True), (33, 60, 8, False), (5, 128, 8, True)])
def test_the_router_picks_torchs_experts(kernel: object, tokens: int, experts: int,
                                          top_k: int, normalize: bool) -> None:
    """`route_f32` against torch's softmax and topk on the same gate logits (the panel
    linear's): the same experts in the same order, weights within float32 rounding."""
    g = torch.Generator().manual_seed(tokens + experts)
    x, gate = torch.randn(tokens, 256, generator=g), torch.randn(experts, 256, generator=g)
    panels = panels_for_cpu(gate, pad=True)
    probs = F.softmax(linear(x, panels), dim=-1, dtype=torch.float32)
    want_w, want_ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    ids, w = kernel.route_f32(x, panels.panels, experts, top_k, normalize)  # type: ignore[attr-defined]
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)


def test_the_router_breaks_ties_to_the_lower_expert(kernel: object) -> None:
    panels = panels_for_cpu(torch.zeros(6, 32), pad=True)  # every logit 0: all tied
    ids, w = kernel.route_f32(torch.randn(2, 32), panels.panels, 6, 3, True)  # type: ignore[attr-defined]
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 3))
    with pytest.raises(RuntimeError, match="top_k <= experts"):
        kernel.route_f32(torch.randn(2, 32), panels.panels, 6, 7, True)  # type: ignore[attr-defined]


@pytest.mark.parametrize(("tokens", "top_k", "slots"), [(0, 2, 4), (1, 4, 64), (37, 8, 130)])
def test_the_layout_sort_is_a_stable_argsort(kernel: object, tokens: int, top_k: int,
                                             slots: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    key = torch.randint(0, slots, (tokens * top_k,), generator=g)
    weights = torch.rand(tokens, top_k, generator=g)
    src, sorted_w, counts = kernel.sort_rows_cpu(key, weights, slots)  # type: ignore[attr-defined]
    order = torch.argsort(key, stable=True)
    assert torch.equal(src, order // top_k)
    assert torch.equal(sorted_w, weights.reshape(-1)[order])
    assert torch.equal(counts, torch.bincount(key, minlength=slots))
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.sort_rows_cpu(torch.tensor([0, slots]), torch.rand(1, 2), slots)  # type: ignore[attr-defined]
