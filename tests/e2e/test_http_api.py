"""Through HTTP with real clients (httpx and the official `openai` package) against
`switchyard serve` running as real processes on loopback."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from switchyard.serve_process import Served
from tests.support.engines import prompts, reference_greedy
from tests.support.serving import client, concurrent_greedy

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny(qwen3_ckpt: tuple) -> Iterator[tuple[Served, str, object]]:
    """The tiny Qwen3-MoE checkpoint: no tokenizer, token-id prompts only."""
    path, model = qwen3_ckpt
    with Served(["--model", str(path), "--max-num-batched-tokens", "16"]) as served:
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        yield served, name, model


def test_token_id_prompts_return_token_ids_equal_to_transformers(tiny: tuple) -> None:
    served, name, model = tiny
    prompt = prompts(seed=11, lengths=(23,))[0]
    out = client(served).completions.create(
        model=name, prompt=prompt, max_tokens=16, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = out.choices[0]
    assert choice.prompt_token_ids == prompt
    assert choice.token_ids == reference_greedy(model, prompt, 16)
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (23, 16)


def test_concurrent_mixed_length_requests_each_equal_transformers(tiny: tuple) -> None:
    served, name, model = tiny
    ps = prompts(seed=12, lengths=(3, 40, 17, 8, 29, 1))
    got = concurrent_greedy(served.url, name, ps, max_tokens=20)
    assert got == [reference_greedy(model, p, 20) for p in ps]




def test_streaming_completion_with_usage(tiny: tuple) -> None:
    served, name, model = tiny
    prompt = prompts(seed=13, lengths=(10,))[0]
    stream = client(served).completions.create(
        model=name, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "ignore_eos": True})
    chunks = list(stream)
    tokens = [t for c in chunks if c.choices for t in (c.choices[0].token_ids or [])]
    assert tokens == reference_greedy(model, prompt, 12)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_text_prompt_without_tokenizer_is_a_clear_400(tiny: tuple) -> None:
    served, name, _ = tiny
    r = httpx.post(f"{served.url}/v1/completions",
                   json={"model": name, "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 400
    assert "tokenizer" in r.json()["error"]["message"]


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status and body["error"]["message"]
    return body["error"]


def test_bad_input_gets_openai_errors_and_service_keeps_serving(tiny: tuple) -> None:
    served, name, model = tiny
    url = f"{served.url}/v1/completions"
    headers = {"content-type": "application/json"}
    error_of(httpx.post(url, content=b'{"model": "x", "prompt": [1, 2', headers=headers), 400)
    error_of(httpx.post(url, json={"model": name, "prompt": [1], "max_tokens": "many"}), 400)
    error_of(httpx.post(url, json={"model": name, "prompt": [1], "max_tokens": 0}), 400)
    error_of(httpx.post(url, json={"model": name, "prompt": [1], "max_tokens": -3}), 400)
    error_of(httpx.post(url, json={"model": name, "prompt": [1], "temperature": "hot"}), 400)
    error_of(httpx.post(url, json={"model": name, "prompt": [10 ** 9], "max_tokens": 2}), 400)
    error_of(httpx.post(url, json={"model": name, "prompt": [1], "max_tokens": 10 ** 6}), 400)
    error_of(httpx.post(url, json=[1, 2, 3]), 400)
    assert "does-not-exist" in error_of(
        httpx.post(url, json={"model": "does-not-exist", "prompt": [1]}), 404)["message"]
    chat = f"{served.url}/v1/chat/completions"
    error_of(httpx.post(chat, json={"model": name, "messages": "hi"}), 400)
    # ... and the next normal request is served correctly.
    prompt = prompts(seed=14, lengths=(5,))[0]
    r = httpx.post(url, json={"model": name, "prompt": prompt, "max_tokens": 8,
                              "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == reference_greedy(model, prompt, 8)
    assert served.proc.poll() is None and all(served.children_alive())  # none restarted


def test_chat_with_the_bundled_model(served_demo: Served) -> None:
    c = client(served_demo)
    models = c.models.list().data
    assert len(models) == 1
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    full = c.chat.completions.create(model=models[0].id, messages=messages, max_tokens=20,
                                     temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    stream = list(c.chat.completions.create(
        model=models[0].id, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert streamed == text
    assert stream[-1].choices == [] and stream[-1].usage == full.usage


def test_sse_wire_format(served_demo: Served) -> None:
    name = httpx.get(f"{served_demo.url}/v1/models").json()["data"][0]["id"]
    with httpx.stream("POST", f"{served_demo.url}/v1/completions", timeout=60, json={
            "model": name, "prompt": "abc", "max_tokens": 5, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and len(events) >= 2  # at least one chunk
    for e in events[:-1]:
        assert json.loads(e.removeprefix("data: "))["object"] == "text_completion"


def test_only_the_compute_services_load_torch(served_demo: Served) -> None:
    """`serve` itself (it checks flags, starts and watches processes) and the gateway never
    map libtorch: each would spend seconds of start-up importing it."""
    def has_torch(pid: int) -> bool:
        return "/libtorch" in Path(f"/proc/{pid}/maps").read_text()

    def role(pid: int) -> str:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[3]  # python -m switchyard X

    assert not has_torch(served_demo.proc.pid)
    assert sorted((role(pid), has_torch(pid)) for pid in served_demo.children) == [
        ("attention", True), ("expert", True), ("expert", True), ("gateway", False)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_every_child_on_signal(qwen3_ckpt: tuple, sig: int) -> None:
    """Also when started in the background (SIGINT inherited as ignored, as a shell's `&`
    and CI runners do): serve stops on the signal itself, not on a later SIGKILL."""
    with Served(["--model", str(qwen3_ckpt[0])], background=True) as served:
        assert len(served.children) == 4 and all(served.children_alive())  # 2 experts,
        assert served.stop(sig) == 0  # attention, gateway
        assert not any(served.children_alive())

