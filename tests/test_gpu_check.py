"""benchmarks/gpu_check.py's harness, on the CPU: a lent GPU gives one run of a few minutes,
so a section must stop at its limit even when its own code catches exceptions, and what a
stopped sweep timed must still become the tuned table."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check


@pytest.fixture(autouse=True)
def fresh_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "ROWS", [])
    monkeypatch.setattr(gpu_check, "JSON_PATH", None)
    monkeypatch.setattr(gpu_check, "DEADLINE", float("inf"))


def test_a_section_that_catches_every_exception_still_stops_at_its_limit() -> None:
    def swallowing() -> None:  # as the sweep does with each failing candidate
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                time.sleep(0.02)
            except Exception:
                continue

    start = time.monotonic()
    gpu_check.guarded("swallower", swallowing, 1)
    assert time.monotonic() - start < 10
    assert gpu_check.ROWS == [{"check": "swallower", "result": "FAIL", "value": "",
                               "note": "did not finish within 1 s"}]


def test_a_sweep_stopped_at_its_limit_keeps_its_timings_as_the_tuned_table(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from benchmarks import gpu_mxfp4
    from moe_kernels.kernel_configs import KernelConfig, config_path, load_configs

    timing = {"gemm": "gate_up", "tokens_per_expert": 1, "variant": "bf16x2/swap",
              "config": [16, 256, 64, 4, 4, 1], "us": 150.0, "weight_tb_s": 3.9,
              "of_copy_bw": 0.8}

    def stopped_sweep(variants: list[str], copy_bw: float, json_path: str | None,
                      results: list[dict[str, object]]) -> None:
        results.append(timing)
        raise gpu_check.SectionTimeout  # as SIGALRM raises it, mid-sweep

    monkeypatch.setattr(gpu_mxfp4, "sweep", stopped_sweep)
    monkeypatch.setattr(gpu_check, "copy_bandwidth", lambda gb: 4.8e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(gpu_check, "KERNEL_VARIANTS", ["bf16x2/swap"])
    monkeypatch.setattr(gpu_check, "KERNEL_CHECKED", [False])  # failed elsewhere
    out = tmp_path / "gpu_check.json"
    gpu_check.guarded("W4A4 kernel sweep", lambda: gpu_check.kernel_sweep(str(out)), 60)

    table = config_path("NVIDIA H200", tmp_path)
    assert load_configs("NVIDIA H200", tmp_path)[1] == KernelConfig(
        inner="bf16x2", swap_ab=True, block_n=16, block_m=256, block_k=64, num_stages=4)
    assert "kernel check failed elsewhere" in json.loads(table.read_text())["source"]
    results = [(r["check"], r["result"]) for r in gpu_check.ROWS]
    assert results == [("W4A4 tuned configs", "info"),
                       ("W4A4 sweep: gate_up, 1 tokens/expert", "info"),
                       ("W4A4 kernel sweep", "FAIL")]
