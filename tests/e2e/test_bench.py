"""Smoke test of `switchyard bench` against the demo model: the report's fields are present
and sane (no speed is asserted)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.bench import make_prompts, percentile, run_load, split_load
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


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=300),
       st.sampled_from([50, 90, 99, 99.9]))
def test_percentiles_are_numpys(values: list[float], q: float) -> None:
    """vllm bench serve reports numpy's percentiles; p99 of 100 values is not their max."""
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)),
                                                  rel=1e-12, abs=1e-9)
    assert percentile([float(i) for i in range(1, 101)], 99) == pytest.approx(99.01)


@given(st.integers(1, 40), st.integers(1, 8), st.integers(1, 200))
def test_load_is_split_in_proportion_to_each_process_share(concurrency: int, processes: int,
                                                           n: int) -> None:
    prompts = [[i] for i in range(n)]
    parts = split_load(prompts, concurrency, 10.0, processes)
    assert sorted(p for part, _, _ in parts for p in part) == prompts  # each prompt once
    assert sum(share for _, share, _ in parts) == concurrency
    assert sum(rate or 0 for _, _, rate in parts) == pytest.approx(10.0)
    for part, share, rate in parts:
        # the prompts per slot of concurrency differ by at most one between processes
        assert abs(len(part) - n * share / concurrency) <= share
        assert rate == pytest.approx(10.0 * share / concurrency)


def test_the_clock_starts_once_every_client_process_is_ready() -> None:
    """Against a closed port every request fails at once: the level's duration is then
    the requests' time, not the seconds spent starting four Python processes."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    start = time.monotonic()
    records, duration = run_load(f"http://127.0.0.1:{port}", "m", [[1]] * 8, 4, 4, None, 4,
                                 0)
    wall = time.monotonic() - start
    assert len(records) == 8 and not any(r.ok for r in records)
    assert 0 < duration < wall / 2, (duration, wall)


def test_a_client_process_that_dies_is_a_clear_error() -> None:
    """A client process that exits early (here with status 3) is named at once, not
    after a five-minute wait for its ready signal."""
    import multiprocessing as mp

    from switchyard.bench import _get

    proc = mp.get_context("spawn").Process(target=exit, args=(3,))
    proc.start()
    proc.join(30)
    with pytest.raises(RuntimeError, match="a client process exited with status 3"):
        _get(mp.get_context("spawn").Queue(), [proc], 10)  # (or: "no answer within 10 s")
