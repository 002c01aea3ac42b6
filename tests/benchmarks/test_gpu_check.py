"""benchmarks/gpu_check.py's harness, on the CPU: a lent GPU gives one run of a few minutes,
so a section must stop at its limit even when its own code catches exceptions, and what a
stopped sweep timed must still become the tuned table."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import gpu_check


@pytest.fixture(autouse=True)
def fresh_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "ROWS", [])
    monkeypatch.setattr(gpu_check, "JSON_PATH", None)
    monkeypatch.setattr(gpu_check, "DEADLINE", float("inf"))
    monkeypatch.setattr(gpu_check, "KERNEL_VARIANTS", [])
    monkeypatch.setattr(gpu_check, "KERNEL_CHECKED", [])


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


def test_the_preflight_child_names_the_kernel_that_failed() -> None:
    """A real child on this machine: its first kernel cannot run without a GPU."""
    from benchmarks.gpu_preflight import KERNELS, QUANTIZE, outcome

    child = subprocess.run([sys.executable, "-m", "benchmarks.gpu_preflight", QUANTIZE,
                            KERNELS[0]], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert child.returncode == 1, child.stderr
    done, failed = outcome(child.stdout, child.returncode)
    assert done == [] and failed is not None and failed[0] == QUANTIZE
    assert failed[1].startswith("FAILED TO RUN: ")


def test_reading_the_preflight_child_back() -> None:
    from benchmarks.gpu_preflight import outcome

    assert outcome("start a\nok a\nstart b\nok b\n", 0) == (["a", "b"], None)
    assert outcome("start a\nok a\nstart b\n", -11) == (
        ["a"], ("b", "the process ended with code -11"))  # a segfault, say
    assert outcome("start a\nerror a: FAILED TO RUN: X: y\n", 1) == (
        [], ("a", "FAILED TO RUN: X: y"))
    assert outcome("", 1) == ([], None)  # it never got to a kernel


def test_a_kernel_that_kills_the_preflight_child_is_kept_out_of_the_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Children scripted to hang at f16 and to die at bf16x2/swap and the quantize kernel:
    each failure is a row, the kernels after it run in a new child, and this process then
    calls the torch quantizer in the kernel's place and checks the GEMM variants without
    f16 and bf16x2/swap."""
    from benchmarks import gpu_mxfp4
    from benchmarks.gpu_preflight import KERNELS, QUANTIZE
    from moe_kernels import mxfp4, triton_mxfp4

    dies_at, children = {QUANTIZE, "bf16x2/swap"}, []

    def child(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        names, lines = cmd[3:], []
        children.append(names)
        for name in names:
            lines.append(f"start {name}")
            out = "\n".join(lines) + "\n"
            if name == "f16":  # killed at the timeout; its output comes back as bytes
                raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=out.encode())
            if name in dies_at:
                return subprocess.CompletedProcess(cmd, -11, out, "")
            lines.append(f"ok {name}")
        return subprocess.CompletedProcess(cmd, 0, "\n".join(lines) + "\n", "")

    monkeypatch.setattr(gpu_check.subprocess, "run", child)
    monkeypatch.setattr(gpu_check, "PREFLIGHT_FAILED", set())
    monkeypatch.setattr(triton_mxfp4, "quantize_mxfp4", triton_mxfp4.quantize_mxfp4)
    gpu_check.guarded("preflight", gpu_check.preflight, 60)
    assert [(r["check"], r["result"], r["note"]) for r in gpu_check.ROWS] == [
        ("preflight: f16", "FAIL", "the process was killed after 90 s"),
        ("preflight: bf16x2/swap", "FAIL", "the process ended with code -11"),
        (f"preflight: {QUANTIZE}", "FAIL", "the process ended with code -11"),
        ("preflight", "FAIL", "each once, small, in a child process")]
    assert gpu_check.ROWS[-1]["value"] == f"{len(KERNELS) - 3} of {len(KERNELS)} kernels ran"
    assert len(children) == 4 and children[0] == KERNELS
    assert children[3] == KERNELS[KERNELS.index(QUANTIZE) + 1:]
    assert triton_mxfp4.quantize_mxfp4 is mxfp4.quantize  # what quantize_fused runs
    assert gpu_mxfp4.check_quantize("cpu") is False  # says so, not "bit-exact"

    checked = []
    monkeypatch.setattr(gpu_mxfp4, "check", lambda args, variants: (
        checked.extend(variants), (True, []))[1])
    gpu_check.kernel()
    assert "bf16x2/swap" not in checked and "f16" not in checked
    assert {"bf16x2", "f16/swap", "dot_scaled"} <= set(checked)


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), max_size=8),
       st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), max_size=8))
def test_the_time_two_streams_are_both_busy_is_that_of_their_busy_instants(
        a: list[tuple[int, int]], b: list[tuple[int, int]]) -> None:
    def spans(pairs: list[tuple[int, int]]) -> list[tuple[float, float]]:
        return [(float(s), float(s + d)) for s, d in pairs]

    def instants(pairs: list[tuple[int, int]]) -> set[int]:  # unit cells [t, t+1) covered
        return {t for s, d in pairs for t in range(s, s + d)}

    ma, mb = gpu_check.merged(spans(a)), gpu_check.merged(spans(b))
    assert all(e1 < s2 for (_, e1), (s2, _) in itertools.pairwise(ma))  # disjoint
    assert sum(e - s for s, e in ma) == len(instants(a))
    assert gpu_check.overlap(ma, mb) == len(instants(a) & instants(b))


def test_stream_busy_reads_kernels_and_copies_per_stream_from_a_chrome_trace() -> None:
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "ts": 10, "dur": 5, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "ts": 12, "dur": 8, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "ts": 30, "dur": 2, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "ts": 14, "dur": 10, "args": {"stream": 21}},
        {"ph": "X", "cat": "cuda_runtime", "ts": 0, "dur": 50, "args": {}},  # host side
        {"ph": "i", "cat": "kernel", "ts": 3, "args": {"stream": 7}},  # no duration
    ]}
    busy = gpu_check.stream_busy(trace)
    assert busy == {7: [(10, 20), (30, 32)], 21: [(14, 24)]}
    assert gpu_check.overlap(busy[7], busy[21]) == 6
