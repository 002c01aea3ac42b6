"""The float grouped SwiGLU two ways: expert by expert (each timed on its own) and as two
`torch._grouped_mm` calls (what CUDA expert banks use where it runs and agrees)."""

from __future__ import annotations

import time

import pytest
import torch

from moe_kernels.grouped_gemm import grouped_swiglu, grouped_swiglu_mm, timed_together
from moe_kernels.selection import grouped_mm_runs

pytest.importorskip("torch", minversion="2.8")  # torch._grouped_mm


def experts(counts: list[int], h: int = 64, i: int = 96, seed: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), h, generator=g)
    return (x, torch.randn(len(counts), 2 * i, h, generator=g) / h**0.5,
            torch.randn(len(counts), h, i, generator=g) / i**0.5)


@pytest.mark.parametrize("counts", [[5, 0, 3], [0, 0, 7], [1], [4, 9, 0, 0, 2, 16]])
def test_grouped_gemms_equal_the_per_expert_loop(counts: list[int]) -> None:
    x, w_gate_up, w_down = experts(counts)
    want = grouped_swiglu(x, counts, w_gate_up, w_down)
    got = grouped_swiglu_mm(x, counts, w_gate_up, w_down)
    assert torch.equal(got, want)  # float32 on the CPU: the same bits
    start = 0
    for e, c in enumerate(counts):  # and both are each expert's FFN, by F.linear
        gate, up = torch.nn.functional.linear(x[start:start + c], w_gate_up[e]).chunk(2, -1)
        ref = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down[e])
        torch.testing.assert_close(got[start:start + c], ref, rtol=1e-5, atol=1e-6)
        start += c


def test_the_grouped_path_is_used_only_where_it_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w_gate_up, w_down = experts([3, 4])
    assert grouped_mm_runs(x, [3, 4], w_gate_up, w_down)

    def wrong(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return torch.zeros(a.shape[0], b.shape[-1])

    def missing(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("grouped gemm is not supported on this device")

    for broken in (wrong, missing):
        monkeypatch.setattr(torch, "_grouped_mm", broken)
        assert not grouped_mm_runs(x, [3, 4], w_gate_up, w_down)


def test_experts_run_together_share_the_calls_span() -> None:
    spans: list[tuple[int, int]] = []
    before = time.time_ns()
    y = timed_together(spans, [2, 0, 5], torch.device("cpu"), lambda: torch.ones(7, 3))
    after = time.time_ns()
    assert torch.equal(y, torch.ones(7, 3))
    assert spans[1] == (0, 0) and spans[0] == spans[2]
    assert before <= spans[0][0] <= spans[0][1] <= after
