"""The bundled demo model answers its task through the whole stack, in every topology."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import torch

from switchyard.demo_model import DEFAULT_MODEL
from switchyard.demo_task import problems
from switchyard.eval import EvalReport, evaluate
from switchyard.serve_process import Served

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def default_serve() -> Iterator[Served]:
    with Served([]) as served:  # no flags: the default model and topology
        yield served


@pytest.fixture(scope="module")
def full_eval(default_serve: Served) -> EvalReport:
    return asyncio.run(evaluate(default_serve.url, num_problems=500, seed=2026,
                                concurrency=32))


def test_exact_match_on_500_fresh_problems(full_eval: EvalReport) -> None:
    assert full_eval.accuracy >= 0.97, full_eval.failures


def test_routing_is_real(full_eval: EvalReport) -> None:
    moe_rows = [row for row in full_eval.expert_load if sum(row)]
    assert len(moe_rows) == 4
    assert all(n > 0 for row in moe_rows for n in row)  # every expert of every layer works
    assert full_eval.max_load_over_fair <= 3.0


def test_transformers_generate_gives_the_same_answers(default_serve: Served) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    probs = problems(seed=7, n=50)
    name = httpx.get(f"{default_serve.url}/v1/models").json()["data"][0]["id"]
    for p in probs:
        messages = [{"role": "user", "content": p.question}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False)
        theirs = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        r = httpx.post(f"{default_serve.url}/v1/chat/completions", timeout=60, json={
            "model": name, "messages": messages, "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["message"]["content"] == theirs, p


@pytest.mark.parametrize("flags", [
    ["--dispatch-backend", "local"],
    ["--expert-services", "1"],
    ["--expert-services", "4"],
    ["--expert-services", "3", "--attention-groups", "2"],
    ["--dispatch-backend", "torch", "--expert-services", "2", "--attention-groups", "2"],
    ["--quantization", "w4a4"],
    ["--dcp-size", "2", "--attention-groups", "2"],
], ids=["local", "rpc-1", "rpc-4", "rpc-3x2", "torch-2x2", "w4a4-rpc-2", "dcp-2x2-rpc-2"])
def test_accuracy_holds_in_every_topology(flags: list[str]) -> None:
    """Short regression version; `switchyard eval -- FLAGS` runs the full one."""
    with Served(flags) as served:
        report = asyncio.run(evaluate(served.url, num_problems=100, seed=99, concurrency=32))
    assert report.accuracy >= 0.93, report.failures  # >= 97% expected; 100 problems of noise
