"""The compiled CPU kernel for float32 experts (`moe_kernels/csrc/grouped_swiglu_cpu.cpp`)
against the torch path (`grouped_swiglu`, expert by expert through torch's matmuls): the
same outputs within float32 summation order, with uneven, empty and prefill-sized experts;
each expert timed on its own; bad input refused; and the torch path where it is off."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from moe_kernels import cpu_kernels
from moe_kernels.grouped_gemm import grouped_swiglu
from moe_kernels.selection import cpu_grouped_swiglu
from tests.support.kernels import assert_expert_spans

pytestmark = pytest.mark.timeout(300)


def weights(experts: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5,
            torch.randn(experts, hidden, inter, generator=g) / inter**0.5)


@pytest.mark.parametrize(("counts", "hidden", "inter"), [
    ([1], 64, 48),  # a decode of one token
    ([0, 1, 3, 0, 2, 4, 0, 1], 64, 48),  # uneven, with empty experts
    ([5, 64, 65, 0, 40], 128, 32),  # either side of the streaming kernel's 64-row limit
    ([0, 0, 0], 64, 16),  # no rows at all
    ([2, 7, 1, 9], 1024, 768),  # the benchmarks' mid-size shapes
])
def test_the_kernel_equals_the_torch_path(kernel: object, counts: list[int], hidden: int,
                                          inter: int) -> None:
    w_gate_up, w_down = weights(len(counts), hidden, inter, seed=sum(counts))
    x = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(1))
    want = grouped_swiglu(x, counts, w_gate_up, w_down)
    spans: list[tuple[int, int]] = []
    got = cpu_grouped_swiglu(x, counts, w_gate_up, w_down, spans)
    assert got is not None and got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32: summation order
    assert_expert_spans(spans, counts)


def test_bad_input_is_refused_with_its_reason(kernel: object) -> None:
    w_gate_up, w_down = weights(2, 64, 16, seed=0)
    x = torch.randn(3, 64)
    for counts, reason in [([1, 1], "do not sum to the rows"), ([4, -1], "negative count"),
                           ([3], "one count per local expert")]:
        with pytest.raises(RuntimeError, match=reason):
            kernel.grouped_swiglu_f32(x, counts, w_gate_up, w_down)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="float32"):
        kernel.grouped_swiglu_f32(x.double(), [1, 2], w_gate_up, w_down)  # type: ignore[attr-defined]


def test_where_it_does_not_apply_the_torch_path_runs(kernel: object) -> None:
    w_gate_up, w_down = weights(2, 40, 24, seed=0)  # H, I not multiples of 16
    assert cpu_grouped_swiglu(torch.randn(3, 40), [1, 2], w_gate_up, w_down, None) is None
    w_gate_up, w_down = weights(2, 64, 16, seed=0)
    assert cpu_grouped_swiglu(torch.randn(3, 64).double(), [1, 2], w_gate_up.double(),
                              w_down.double(), None) is None


def test_a_machine_that_cannot_build_it_says_so_once(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    import torch.utils.cpp_extension as cpp

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp, "load", no_compiler)
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setattr(cpu_kernels, "_failed", False)
    caplog.set_level(logging.INFO, logger="switchyard.expert")
    w_gate_up, w_down = weights(1, 64, 16, seed=0)
    for _ in range(3):
        assert cpu_grouped_swiglu(torch.randn(2, 64), [2], w_gate_up, w_down, None) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "could not be built" in warnings[0] and \
        "Ninja is required" in warnings[0] and "torch's matmuls" in warnings[0], warnings


def test_switched_off_it_is_never_built() -> None:
    out = subprocess.run([sys.executable, "-c", (
        "from moe_kernels import cpu_kernels as k; import torch.utils.cpp_extension as c\n"
        "c.load = None  # any build would raise\n"
        "assert k.cpu_kernels() is None and k.cpu_kernels() is None; print('off')")],
        env={"SWITCHYARD_CPU_KERNELS": "0", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "off", out.stderr
