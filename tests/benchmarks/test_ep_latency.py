"""benchmarks/ep_latency.py on loopback: the lockstep backends' dispatch + combine across
rank processes, built as the services build them, with identity experts checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("quantization", [[], ["--quantization", "w4a4"]], ids=["float", "w4a4"])
def test_two_attention_and_two_expert_ranks(tmp_path: Path, quantization: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.ep_latency", "--attention-ranks", "2",
         "--expert-ranks", "2", "--tokens", "16", "--hidden", "64", "--experts", "16",
         "--top-k", "4", "--warmup", "1", "--iters", "3", "--timeout", "120",
         "--json", str(tmp_path / "r.json"), *quantization],
        capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    (result,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert result["backend"] == "torch" and result["max_rel_err"] < 1e-5
    assert 0 < result["p10_us"] <= result["median_us"] <= result["p90_us"]
    assert "| torch |" in out.stdout and "| ok |" in out.stdout


def test_a_backend_that_cannot_start_is_a_failed_row_not_a_hang() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.ep_latency", "--backends", "nccl",
         "--expert-ranks", "1", "--tokens", "4", "--hidden", "64", "--experts", "16",
         "--top-k", "2", "--iters", "1", "--warmup", "0", "--timeout", "60"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "| nccl | - | - | FAIL: ValueError: the nccl dispatch backend" in out.stdout
