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
import pytest
import torch

from common.failures import root_causes
from common.messages import GenerateRequest, SamplingParams
from ep_dispatch.layout import compute_layout
from ep_dispatch.placement import Placement
from ep_dispatch.wire import from_wire, to_wire
from services.attention.engine import StepFailed
from services.attention.warmup import warmup_prompt
from switchyard.serve_process import Served
from tests.support import TESTS
from tests.support.engines import engine_for, greedy

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


def test_root_causes_are_the_leaves_of_exception_groups_once_each() -> None:
    numpy = RuntimeError("Numpy is not available")
    nested = ExceptionGroup("unhandled errors in a TaskGroup", [
        numpy, ExceptionGroup("inner", [RuntimeError("Numpy is not available"),
                                        TimeoutError()])])
    assert root_causes(nested) == "RuntimeError: Numpy is not available; TimeoutError"
    assert root_causes(ValueError("bad")) == "ValueError: bad"


def test_a_warm_up_reaches_every_replica_of_every_expert(qwen3_ckpt: tuple) -> None:
    """The warm-up's rows are routed to experts by position so that a layout gives every
    replica of every expert a row, whatever replica turn a layer call starts at; its KV
    is never found by another request. Its rows count as load: R per expert."""
    engine = engine_for(qwen3_ckpt[0], dispatch_backend="local", expert_replicas=2,
                        max_num_batched_tokens=64)
    cfg, calls = engine.model_config, []
    inner = engine.runner.experts

    def recording(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
                  ) -> torch.Tensor:
        calls.append((layer, ids.clone()))
        return inner(layer, x, ids, w)

    engine.runner.experts = recording  # type: ignore[assignment]
    engine.runner.experts.begin_step = inner.begin_step  # type: ignore[attr-defined]
    warmup = GenerateRequest("w", [], SamplingParams(max_tokens=1, temperature=0.0),
                             warmup=True)
    assert engine.add(warmup) is None
    [delta] = engine.step()
    assert (delta.finish_reason, delta.error) == ("length", None)
    assert [layer for layer, _ in calls] == cfg.moe_layer_ids
    placement = Placement.balanced(cfg.moe_layer_ids, cfg.num_experts, 3, replicas=2)
    for layer, ids in calls:
        for turn in range(3):
            layout = compute_layout(ids, torch.ones_like(ids, dtype=torch.float32),
                                    placement, layer, turn)
            assert all(all(c > 0 for c in counts) for counts in layout.expert_counts), (
                layer, turn, layout.expert_counts)
    load = engine.runner.model.expert_load  # [layers, E]
    moe = len(cfg.moe_layer_ids)
    assert (load[cfg.moe_layer_ids] == 2).all() and int(load.sum()) == 2 * cfg.num_experts * moe
    prompt = warmup_prompt(cfg, 2, engine.max_model_len)
    assert engine.add(greedy("same tokens", prompt, 1)) is None
    [delta] = engine.step()
    assert delta.num_cached_tokens == 0


def test_a_failed_step_fails_only_its_own_sequences(qwen3_ckpt: tuple) -> None:
    """A step that raises names the sequences it ran; a waiting one, not in it, is
    untouched and completes."""
    engine = engine_for(qwen3_ckpt[0], dispatch_backend="local", max_num_seqs=1)
    inner = engine.runner.experts
    failing = [True]

    def experts(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
                ) -> torch.Tensor:
        if failing[0]:
            raise ExceptionGroup("unhandled errors in a TaskGroup",
                                 [RuntimeError("rank 0 down"), RuntimeError("rank 1 down")])
        return inner(layer, x, ids, w)

    engine.runner.experts = experts  # type: ignore[assignment]
    engine.runner.experts.begin_step = inner.begin_step  # type: ignore[attr-defined]
    assert engine.add(greedy("first", [1, 2, 3], 2)) is None
    assert engine.add(greedy("waiting", [4, 5, 6], 2)) is None
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["first"]
    assert str(failed.value) == "RuntimeError: rank 0 down; RuntimeError: rank 1 down"
    [delta] = engine.fail(failed.value.request_ids, "error")
    assert (delta.request_id, delta.finish_reason, delta.retryable) == ("first", "error", True)
    failing[0] = False
    tokens = []
    while engine.has_work():
        tokens += [(d.request_id, len(d.token_ids)) for d in engine.step()]
    assert tokens == [("waiting", 1), ("waiting", 1)]


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


def test_wire_round_trip_of_views_and_empty_tensors() -> None:
    for t in (torch.randn(5, 3)[:, 1], torch.empty(0, 4), torch.tensor(3, dtype=torch.int64),
              torch.randn(4, 4, dtype=torch.bfloat16).t()):
        back = from_wire(to_wire(t))
        assert back.dtype == t.dtype and torch.equal(back, t)
