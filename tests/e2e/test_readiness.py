"""Readiness that means serving, and failures that name their cause.

`serve` prints its URL (and `/health` answers 200) only after a warm-up generation went
through every attention group and every expert rank; a warm-up that fails stops `serve`,
naming the service. A step that fails answers its own requests with the root cause (not
"unhandled errors in a TaskGroup"), and the engine serves on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from switchyard.serve_process import Served
from tests.support import TESTS

FAULTS = TESTS / "support" / "faults"  # sitecustomize.py: faults in real processes
ASK = {"model": "switchyard-arith-moe", "temperature": 0, "max_tokens": 8,
       "messages": [{"role": "user", "content": "What is 123 + 456?"}]}


def faulty(fault: str) -> dict[str, str]:
    """The environment that injects `fault` into the services `serve` starts."""
    path = os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "SWITCHYARD_TEST_FAULT": fault}


def test_serve_stops_naming_an_expert_rank_that_cannot_compute() -> None:
    """Expert rank 1 answers its handshake (so the old /health said 200) but fails every
    layer call: the warm-up fails, and `serve` exits non-zero naming rank 1 and why,
    without ever saying it serves."""
    proc = subprocess.run([sys.executable, "-m", "switchyard", "serve", "--port", "0"],
                          env={**os.environ, **faulty("expert-compute:1")},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "is serving" not in proc.stdout
    [said] = [line for line in proc.stderr.splitlines()
              if line.startswith("switchyard serve:")]  # (the children log around it)
    assert said.startswith("switchyard serve: warm-up failed on attention service"), said
    assert "expert rank 1 at 127.0.0.1:" in said, said
    assert "RuntimeError: injected fault: this expert rank cannot compute" in said, said


def test_a_failed_steps_503_names_its_root_cause_and_the_engine_serves_on(
        tmp_path: Path) -> None:
    """The first-run failure of issue 26: tensors that cannot become wire bytes (which
    then failed both expert ranks' calls inside one task group). The 503 says what
    failed, not "unhandled errors in a TaskGroup (2 sub-exceptions)", nor an expert rank
    that is not at fault; once the cause is gone the same service answers again."""
    armed = tmp_path / "armed"
    with Served([], env=faulty(f"wire-bytes:{armed}")) as served:
        ok = httpx.post(f"{served.url}/v1/chat/completions", json=ASK, timeout=60)
        assert ok.status_code == 200, ok.text
        armed.touch()
        failed = httpx.post(f"{served.url}/v1/chat/completions", json=ASK, timeout=60)
        assert failed.status_code == 503, failed.text
        message = failed.json()["error"]["message"]
        assert message == ("The engine is unavailable: internal engine error: "
                           "RuntimeError: Numpy is not available"), message
        armed.unlink()
        again = httpx.post(f"{served.url}/v1/chat/completions", json=ASK, timeout=60)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["message"]["content"] == "579"
        log = served.stderr()  # the traceback logged once, by the engine
        assert log.count("engine step failed") == 1
        assert log.count("Traceback") == 1 and "Exception Group" not in log


def test_wire_bytes_need_no_numpy() -> None:
    """The base install has no numpy (torch does not depend on it): tensors still go to
    and from wire bytes, and a DCP plan still decodes."""
    code = """
import sys
sys.modules["numpy"] = None  # what `import numpy` finds: an ImportError
import torch
from ep_dispatch.wire import from_wire, tensor_bytes, to_wire
x = torch.arange(12, dtype=torch.float32).view(3, 4)[1:]
assert torch.equal(from_wire(to_wire(x)), x)
assert tensor_bytes(torch.tensor([7], dtype=torch.uint8)) == bytes([7])
try:
    x.numpy()
except RuntimeError as exc:
    print(exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Numpy is not available" in out.stdout  # numpy really was out of reach

