"""Smoke test of `switchyard bench` against the demo model: the report's fields are present
and sane (no speed is asserted)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from switchyard.bench import run_load
from switchyard.serve_process import Served

pytestmark = pytest.mark.timeout(300)


def test_bench_reports_every_field(served_demo_local: Served, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "switchyard", "bench", "--url", served_demo_local.url,
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
