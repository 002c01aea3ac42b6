"""No request lost when an attention group dies: `serve` starts the group again, and the
gateway resubmits each of its requests (to another group, or to the same one once it is
back) as its prompt plus the tokens it had streamed. Each stream goes on unbroken, with
the tokens an undisturbed run gives: transformers' for greedy, the same draws for seeded
sampling."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
from pathlib import Path

import httpx
import pytest

from switchyard.serve_process import Served
from tests.support.engines import prompts, reference_greedy

pytestmark = pytest.mark.timeout(300)
N = 96  # tokens a stream: long enough to be cut in the middle


def a_service(served: Served, kind: str, rank: int | None = None) -> int:
    """The process of one service of `kind` ("attention", "expert"; an expert's
    `rank`), by its command line. With least-busy routing, each of two attention groups
    runs half the streams."""
    for pid in served.children:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if kind in args and (rank is None or args[args.index("--rank") + 1] == str(rank)):
            return pid
    raise AssertionError(f"no {kind} service among {served.children}")


def stream(url: str, model: str, prompt: list[int], sampling: dict, first: threading.Event,
           out: dict) -> None:
    """One streamed completion: its token ids, finish reason and usage into `out`;
    `first` set once a few tokens came."""
    tokens: list[int] = []
    out["tokens"] = tokens
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": N, "ignore_eos": True,
            "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **sampling}) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                tokens += choice.get("token_ids") or []
                out["finish"] = choice.get("finish_reason") or out.get("finish")
            if len(tokens) >= 4:
                first.set()


def run(served: Served, ps: list[list[int]], sampling: dict, kill: int | None) -> list[dict]:
    """Stream every prompt at once; SIGKILL process `kill` once every stream has its
    first tokens."""
    model = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
    outs: list[dict] = [{} for _ in ps]
    firsts = [threading.Event() for _ in ps]
    threads = [threading.Thread(target=stream, args=(served.url, model, p, sampling, f, o))
               for p, f, o in zip(ps, firsts, outs, strict=True)]
    for t in threads:
        t.start()
    try:
        assert all(f.wait(60) for f in firsts)
        if kill is not None:
            os.kill(kill, signal.SIGKILL)
    finally:
        for t in threads:
            t.join(180)
    for p, out in zip(ps, outs, strict=True):
        assert out["status"] == 200 and out["finish"] == "length", out
        assert out["usage"]["completion_tokens"] == N == len(out["tokens"])
        assert out["usage"]["prompt_tokens"] == len(p)
    return outs


@pytest.mark.parametrize("groups", [2, 1])
def test_greedy_streams_outlive_their_attention_group(qwen3_ckpt: tuple, groups: int) -> None:
    """SIGKILL an attention group while greedy streams run on it: with 2 groups the
    other takes them over, with 1 the same one once `serve` has started it again; every
    stream is transformers' tokens, whole."""
    path, model = qwen3_ckpt
    ps = prompts(seed=41, lengths=(9, 23, 5, 17))
    want = [reference_greedy(model, p, N) for p in ps]
    with Served(["--model", str(path), "--attention-groups", str(groups),
                 "--routing-policy", "least-busy"]) as served:
        outs = run(served, ps, {"temperature": 0}, kill=a_service(served, "attention"))
        assert [o["tokens"] for o in outs] == want
        assert re.search(r"attention group \d exited with status -9; starting it again",
                         served.stderr())
        assert "resubmitting" in served.stderr()


def test_seeded_sampling_draws_the_same_tokens_across_a_failover(qwen3_ckpt: tuple) -> None:
    """Each seeded draw depends on the seed and the token's position only, so a stream
    resumed on the other group samples what it would have."""
    path, _ = qwen3_ckpt
    ps = prompts(seed=42, lengths=(12, 7, 19))
    with Served(["--model", str(path), "--attention-groups", "2",
                 "--routing-policy", "least-busy"]) as served:
        sampling = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}
        undisturbed = run(served, ps, sampling, kill=None)
        moved = run(served, ps, sampling, kill=a_service(served, "attention"))
        assert "resubmitting" in served.stderr()
    assert [o["tokens"] for o in moved] == [o["tokens"] for o in undisturbed]


def test_no_request_fails_while_an_expert_service_without_replicas_restarts(
        qwen3_ckpt: tuple) -> None:
    """SIGKILL an expert service whose experts have no replica while greedy streams run:
    the attention service holds its step until `serve` has started the service again
    (within --expert-timeout), sends the held layer call again, and every stream is
    transformers' tokens, whole."""
    path, model = qwen3_ckpt
    ps = prompts(seed=43, lengths=(9, 23, 5, 17))
    want = [reference_greedy(model, p, N) for p in ps]
    with Served(["--model", str(path), "--expert-services", "2"]) as served:
        outs = run(served, ps, {"temperature": 0}, kill=a_service(served, "expert", rank=1))
        assert [o["tokens"] for o in outs] == want
        log = served.stderr()
        assert "expert rank 1 exited with status -9; starting it again" in log
        assert "holding the step" in log and "the held layer call is sent again" in log
