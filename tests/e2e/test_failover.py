"""No request lost when a service dies. When an attention group dies (or a rank it meets
in a rendezvous: a DCP peer, a collective backend's expert rank), `serve` starts the
group again with its partners, and the gateway resubmits each of its requests (to another
group, or to the same one once it is back) as its prompt plus the tokens it had streamed.
Each stream goes on unbroken, with the tokens an undisturbed run gives: transformers' for
greedy, the same draws for seeded sampling. An `rpc` expert service that dies is waited
for, its layer call held."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from switchyard.serve_process import Served
from tests.support.engines import prompts, reference_greedy
from tests.support.metrics_text import scrape
from tests.support.serving import concurrent_greedy, disturbed_streams, model_id
from tests.support.tools import wait_until

pytestmark = pytest.mark.timeout(300)
N = 96  # tokens a stream: long enough to be cut in the middle


def run(served: Served, ps: list[list[int]], sampling: dict, kill: int | None) -> list[dict]:
    """Stream every prompt at once; SIGKILL process `kill` once every stream has its
    first tokens."""
    model = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
    body = {"max_tokens": N, "ignore_eos": True, **sampling}
    outs = disturbed_streams(served.url, model, ps, body,
                             None if kill is None else lambda: os.kill(kill, signal.SIGKILL))
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
        outs = run(served, ps, {"temperature": 0}, kill=served.service("attention group"))
        assert [o["tokens"] for o in outs] == want
        assert re.search(r"attention group \d exited with status -9; starting it again",
                         served.stderr())
        assert "resubmitting" in served.stderr()


def test_a_resumed_request_goes_on_speculating(deepseek_v3_mtp_ckpt: tuple) -> None:
    """MTP speculation on (a DeepSeek-V3 with its MTP layer): an attention group killed
    mid-stream, its greedy streams resumed on the other are transformers' tokens, whole,
    and drafts were verified throughout (a resubmitted prompt rebuilds its MTP KV)."""
    path, model, _ = deepseek_v3_mtp_ckpt
    ps = prompts(seed=46, lengths=(9, 23, 5))
    want = [reference_greedy(model, p, N) for p in ps]
    spec = '{"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": null}'
    with Served(["--model", str(path), "--attention-groups", "2", "--routing-policy",
                 "least-busy", "--speculative-config", spec]) as served:
        outs = run(served, ps, {"temperature": 0}, kill=served.service("attention group"))
        assert [o["tokens"] for o in outs] == want
        assert "resubmitting" in served.stderr()
        drafted = scrape(f"{served.url}/metrics")["switchyard:spec_decode_num_draft_tokens_total"]
        assert sum(drafted.values()) > 0


def test_seeded_sampling_draws_the_same_tokens_across_a_failover(qwen3_ckpt: tuple) -> None:
    """Each seeded draw depends on the seed and the token's position only, so a stream
    resumed on the other group samples what it would have."""
    path, _ = qwen3_ckpt
    ps = prompts(seed=42, lengths=(12, 7, 19))
    with Served(["--model", str(path), "--attention-groups", "2",
                 "--routing-policy", "least-busy"]) as served:
        sampling = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}
        undisturbed = run(served, ps, sampling, kill=None)
        moved = run(served, ps, sampling, kill=served.service("attention group"))
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
        outs = run(served, ps, {"temperature": 0}, kill=served.services()["expert rank 1"])
        assert [o["tokens"] for o in outs] == want
        log = served.stderr()
        assert "expert rank 1 exited with status -9; starting it again" in log
        assert "holding the step" in log and "the held layer call is sent again" in log


@pytest.mark.parametrize("victim", ["leader", "peer"])
def test_greedy_streams_outlive_a_dcp_rank(qwen3_ckpt: tuple, victim: str) -> None:
    """A DCP group's leader or peer SIGKILLed mid-stream: `serve` kills its partner and
    starts the group again, both ranks (they rendezvous together); the gateway resubmits
    the group's streams to it once back, and every stream is transformers' tokens,
    whole. A request sent while the group is down waits for it."""
    path, model = qwen3_ckpt
    ps = prompts(seed=44, lengths=(9, 23, 5, 17))
    want = [reference_greedy(model, p, N) for p in ps]
    with Served(["--model", str(path), "--dcp-size", "2"]) as served:
        pid = next(pid for name, pid in served.services().items()
                   if name.startswith("attention") and ("DCP" in name) == (victim == "peer"))
        outs = run(served, ps, {"temperature": 0}, kill=pid)
        assert [o["tokens"] for o in outs] == want
        log = served.stderr()
        assert re.search(r"attention group \d( DCP rank 1)? exited with status -9; starting "
                         r"it \(and with it attention group \d( DCP rank 1)?\) again", log), log
        assert "resubmitting" in log
        os.kill(served.service("attention group"), signal.SIGKILL)  # and at once a request:
        assert concurrent_greedy(served.url, model_id(served), ps[:1], N) == want[:1]


def test_greedy_streams_outlive_a_collective_worlds_rank(qwen3_ckpt: tuple) -> None:
    """The torch (gloo) backend: an expert rank SIGKILLed mid-stream takes its world
    down; `serve` starts every attention and expert rank again, together, and every
    stream is transformers' tokens, whole."""
    path, model = qwen3_ckpt
    ps = prompts(seed=45, lengths=(9, 23, 5))
    want = [reference_greedy(model, p, N) for p in ps]
    with Served(["--model", str(path), "--dispatch-backend", "torch"]) as served:
        outs = run(served, ps, {"temperature": 0}, kill=served.services()["expert rank 1"])
        assert [o["tokens"] for o in outs] == want
        log = served.stderr()
        assert re.search(r"expert rank 1 exited with status -9; starting it \(and with it "
                         r"expert rank 0, attention group 0\) again", log), log


def test_the_gateway_comes_back_where_it_was() -> None:
    """SIGKILL the gateway: `serve` starts it again on the port its URL names (its
    clients' connections went with it); the demo model answers there again."""
    with Served([]) as served:
        os.kill(served.services()["gateway"], signal.SIGKILL)

        def answers() -> bool:
            try:
                return httpx.get(f"{served.url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False  # not listening yet

        wait_until(answers, timeout=120)
        r = httpx.post(f"{served.url}/v1/chat/completions", timeout=60, json={
            "model": model_id(served), "temperature": 0,
            "messages": [{"role": "user", "content": "What is 123 + 456?"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "579"
        assert "gateway exited with status -9; starting it again" in served.stderr()
