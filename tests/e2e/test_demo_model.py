"""The bundled demo model answers its task through the whole stack, in every topology:
the questions a person tries first, and 1,000 held-out problems in float32 and W4A4, with
every slice of operand sizes at least 96% right."""

from __future__ import annotations

import asyncio
from contextlib import nullcontext

import httpx
import pytest
import torch

from switchyard.demo_model import DEFAULT_MODEL
from switchyard.demo_task import problems
from switchyard.eval import EvalReport, evaluate
from switchyard.serve_process import Served

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def full_eval(served_demo: Served) -> EvalReport:  # no flags: the default model, topology
    return asyncio.run(evaluate(served_demo.url, num_problems=1000, seed=2026,
                                concurrency=32))


def check_accuracy(report: EvalReport) -> None:
    """The bundled model's aims: 98% overall, 96% in every digit-count slice."""
    assert report.accuracy >= 0.98, report.failures
    digit_slices = [name for name in report.slices if "x" in name]
    assert len(digit_slices) == 9
    for name in digit_slices:
        assert report.slice_accuracy(name) >= 0.96, (name, report.slices, report.failures)


def test_exact_match_on_1000_held_out_problems(full_eval: EvalReport) -> None:
    check_accuracy(full_eval)


def test_exact_match_in_w4a4(served_demo_w4a4: Served) -> None:
    check_accuracy(asyncio.run(evaluate(served_demo_w4a4.url, num_problems=1000, seed=2026,
                                        concurrency=32)))


FIRST_QUESTIONS = {  # what a person asks first, and their like
    "What is 1 + 1?": "2", "What is 2 + 2?": "4", "What is 0 + 0?": "0",
    "What is 10 - 3?": "7", "What is 3 - 10?": "-7", "What is 999 + 999?": "1998",
    "What is 100 - 1?": "99", "What is 5 + 7?": "12", "What is 9 - 9?": "0",
    "What is 19 + 0?": "19", "What is 17 + 25?": "42", "What is 3 - 7?": "-4",
    "What is 0 - 0?": "0", "What is 99 + 1?": "100", "What is 50 - 75?": "-25",
    "What is 123 + 456?": "579", "What is 900 - 937?": "-37", "What is 1 - 999?": "-998",
    "What is 910 - 912?": "-2", "What is 100 - 9?": "91", "What is 500 - 499?": "1",
    "What is 999 - 999?": "0", "What is 1 + 999?": "1000",
}


def test_the_questions_people_ask_first(served_demo: Served) -> None:
    name = httpx.get(f"{served_demo.url}/v1/models").json()["data"][0]["id"]
    got = {}
    for question in FIRST_QUESTIONS:
        r = httpx.post(f"{served_demo.url}/v1/chat/completions", timeout=60, json={
            "model": name, "messages": [{"role": "user", "content": question}],
            "max_tokens": 8, "temperature": 0})
        got[question] = r.json()["choices"][0]["message"]["content"]
    assert got == FIRST_QUESTIONS


def test_routing_is_real(full_eval: EvalReport) -> None:
    moe_rows = [row for row in full_eval.expert_load if sum(row)]
    assert len(moe_rows) == 3  # layers 1-3 (layer 0 is dense, as DeepSeek's first ones)
    assert all(n > 0 for row in moe_rows for n in row)  # every expert of every layer works
    assert full_eval.max_load_over_fair <= 3.0


def test_transformers_generate_gives_the_same_answers(served_demo: Served) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    probs = problems(seed=7, n=50)
    name = httpx.get(f"{served_demo.url}/v1/models").json()["data"][0]["id"]
    for p in probs:
        messages = [{"role": "user", "content": p.question}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False)
        theirs = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        r = httpx.post(f"{served_demo.url}/v1/chat/completions", timeout=60, json={
            "model": name, "messages": messages, "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["message"]["content"] == theirs, p


SHARED = {("--dispatch-backend", "local"): "served_demo_local",  # tests/e2e/conftest.py
          ("--quantization", "w4a4"): "served_demo_w4a4"}


@pytest.mark.parametrize("flags", [
    ["--dispatch-backend", "local"],
    ["--expert-services", "1"],
    ["--expert-services", "4"],
    ["--expert-services", "3", "--attention-groups", "2"],
    ["--dispatch-backend", "torch", "--expert-services", "2", "--attention-groups", "2"],
    ["--quantization", "w4a4"],
    ["--dcp-size", "2", "--attention-groups", "2"],
], ids=["local", "rpc-1", "rpc-4", "rpc-3x2", "torch-2x2", "w4a4-rpc-2", "dcp-2x2-rpc-2"])
def test_accuracy_holds_in_every_topology(flags: list[str],
                                         request: pytest.FixtureRequest) -> None:
    """Short regression version; `switchyard eval -- FLAGS` runs the full one."""
    shared = SHARED.get(tuple(flags))  # started with these flags for other tests too
    with (nullcontext(request.getfixturevalue(shared)) if shared else Served(flags)) as served:
        report = asyncio.run(evaluate(served.url, num_problems=100, seed=99, concurrency=32))
    assert report.accuracy >= 0.95, report.failures  # 100% measured on 5,000 (benchmarks.md)
