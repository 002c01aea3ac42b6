"""Smoke test of `switchyard bench` against the demo model: the report's fields are present
and sane (no speed is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from switchyard.bench import make_prompts
from switchyard.serve_process import Served

pytestmark = pytest.mark.timeout(300)


def test_prompts_are_fixed_by_the_seed_and_share_their_prefix() -> None:
    a = make_prompts(5, 20, 0.5, 100, seed=1)
    assert a == make_prompts(5, 20, 0.5, 100, seed=1) != make_prompts(5, 20, 0.5, 100, seed=2)
    assert all(len(p) == 20 and p[:10] == a[0][:10] for p in a)
    assert len({tuple(p[10:]) for p in a}) == 5


def test_bench_reports_every_field(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    with Served(["--dispatch-backend", "local"]) as served:
        proc = subprocess.run(
            [sys.executable, "-m", "switchyard", "bench", "--url", served.url,
             "--concurrency", "1", "3", "--num-prompts", "6", "--input-len", "12",
             "--output-len", "5", "--client-processes", "2", "--shared-prefix-fraction",
             "0.5", "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "TTFT mean/med/p99 ms" in proc.stdout
    reports = json.loads(out.read_text())
    assert [r["concurrency"] for r in reports] == [1, 3]
    assert [r["client_processes"] for r in reports] == [1, 2]
    for r in reports:
        assert (r["completed"], r["failed"]) == (6, 0)
        assert r["output_throughput"] == pytest.approx(6 * 5 / r["duration_s"])
        assert r["total_token_throughput"] == pytest.approx(6 * 17 / r["duration_s"])
        for metric in ("ttft", "tpot", "itl", "e2e"):
            s = r[metric]
            assert 0 < s["median_ms"] <= s["p99_ms"] and s["mean_ms"] > 0
        assert r["e2e"]["mean_ms"] > r["ttft"]["mean_ms"]
