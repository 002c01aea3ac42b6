"""The gateway over real HTTP (uvicorn on loopback) against an in-test fake engine."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import openai
import pytest
import uvicorn
from tokenizers import Tokenizer as BackendTokenizer
from transformers import AutoTokenizer

from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.routing.engine_pool import EnginePool
from gateway.server import bind
from gateway.text.tokenizer import Tokenizer
from tests.support.gateway import HANG, REJECT, REPLY, FakeEngine, sse_events, write_checkpoint

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
MODEL = "tiny-moe"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn runs on asyncio


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("gateway") / MODEL)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    loaded = Tokenizer.load(model_dir)
    assert loaded is not None
    return loaded


@dataclass
class Stack:
    """A fake engine, the gateway in front of it, and an HTTP client for the gateway."""

    engine: FakeEngine
    client: EnginePool
    http: httpx.AsyncClient
    url: str


@asynccontextmanager
async def serve_gateway(model_dir: Path, engine: FakeEngine, *more: FakeEngine,
                        **settings: Any) -> AsyncIterator[Stack]:
    """The gateway in front of `engine` (and `more` attention groups); `settings`: other
    GatewayConfig fields."""
    config = GatewayConfig(model_dir=model_dir, served_model_name=model_dir.name,
                           engines=tuple(("127.0.0.1", e.port) for e in (engine, *more)),
                           port=0, **settings)
    client = EnginePool(list(config.engines), retry_interval_s=0.01,
                        failover_timeout_s=config.failover_timeout_s)
    app = build_app(config, client, Tokenizer.load(model_dir))
    sock = bind(config.host, config.port)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    async with anyio.create_task_group() as tg, httpx.AsyncClient(base_url=url, timeout=10) as http:
        tg.start_soon(server.serve, [sock])
        with anyio.fail_after(5):
            await client.wait_warm()
        try:
            yield Stack(engine, client, http, url)
        finally:
            server.should_exit = True


@pytest.fixture
async def stack(model_dir: Path, tokenizer: Tokenizer) -> AsyncIterator[Stack]:
    eos = tokenizer.backend.token_to_id("<|im_end|>")
    async with FakeEngine(tokenizer.encode(REPLY), eos).running() as engine, \
            serve_gateway(model_dir, engine) as served:
        yield served


def error_of(response: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    """The error object, after checking the exact OpenAI error body shape."""
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["code"], body["error"]["type"]) == (status, kind)
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


async def test_chat_completion(stack: Stack, tokenizer: Tokenizer, model_dir: Path) -> None:
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]
    r = await stack.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": parts}], "temperature": 0,
        "top_k": 5, "seed": 3, "unknown_field": {"ignored": True}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["object"], body["model"]) == ("chat.completion", MODEL)
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": REPLY,
                                  "tool_calls": []}  # (vLLM: always a list)
    assert choice["finish_reason"] == "stop"
    sent = stack.engine.requests[0]
    expected = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        [{"role": "user", "content": "What is\nthe capital?"}], add_generation_prompt=True,
        tokenize=True, return_dict=False)  # the reference: transformers' template
    assert sent.prompt_token_ids == expected and sent.request_id == body["id"]
    assert (sent.sampling.temperature, sent.sampling.top_k, sent.sampling.seed) == (0.0, 5, 3)
    assert sent.sampling.max_tokens == 256 - len(expected)
    completion_tokens = len(tokenizer.encode(REPLY)) + 1  # the EOS counts, as in vLLM
    assert body["usage"] == {"prompt_tokens": len(expected), "completion_tokens": completion_tokens,
                             "total_tokens": len(expected) + completion_tokens}


async def test_chat_without_the_generation_prompt(stack: Stack, model_dir: Path) -> None:
    """vLLM's `add_generation_prompt: false`, as a field or through the template's
    variables; the conversation itself cannot be replaced that way."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    for fields in ({"add_generation_prompt": False},  # or as a template variable (vLLM's)
                   {"chat_template_kwargs": {"add_generation_prompt": False}}):
        r = await stack.http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, **fields})
        assert r.status_code == 200, r.text
        assert stack.engine.requests[-1].prompt_token_ids == hf.apply_chat_template(
            messages, add_generation_prompt=False, tokenize=True, return_dict=False)
    r = await stack.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and "may not set messages" in r.text
    # the reply continues the last message's turn: its role (vLLM)
    for last in ("user", "assistant"):
        turns = [{"role": "user", "content": "Hi"}, {"role": last, "content": "Hel"}]
        r = await stack.http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": turns, "add_generation_prompt": False})
        assert r.json()["choices"][0]["message"]["role"] == last
        async with stack.http.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": turns, "add_generation_prompt": False,
                "stream": True}) as s:
            first = json.loads(sse_events((await s.aread()).decode())[0])
        assert first["choices"][0]["delta"]["role"] == last


async def test_continue_final_message_and_chat_echo(stack: Stack, model_dir: Path) -> None:
    """vLLM's `continue_final_message`: the prompt ends inside the last message, as
    transformers renders it; `echo` starts the reply with that message's content."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    want = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        messages, continue_final_message=True, tokenize=True, return_dict=False)
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": False,
            "continue_final_message": True}
    r = await stack.http.post("/v1/chat/completions", json={**body, "echo": True})
    assert stack.engine.requests[-1].prompt_token_ids == want
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hel" + REPLY,
                                                 "tool_calls": []}
    async with stack.http.stream("POST", "/v1/chat/completions", json={
            **body, "echo": True, "stream": True}) as s:
        chunks = [json.loads(e) for e in sse_events((await s.aread()).decode())[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        "Hel" + REPLY
    tokenized = await stack.http.post("/tokenize", json=body)
    assert tokenized.json()["tokens"] == want
    plain = await stack.http.post("/v1/chat/completions", json={  # the user's turn: no echo
        "model": MODEL, "messages": messages[:1], "echo": True})
    assert plain.json()["choices"][0]["message"]["content"] == REPLY
    both = await stack.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "continue_final_message": True})
    assert error_of(both, 400, "BadRequestError")["param"] == "continue_final_message"


async def test_truncate_prompt_tokens_keeps_the_last_ones(stack: Stack) -> None:
    """vLLM's `truncate_prompt_tokens`: the prompt's last k tokens (-1: what fits)."""
    for keep, want in ((2, [7, 8]), (9, [5, 6, 7, 8]), (-1, [5, 6, 7, 8])):
        r = await stack.http.post("/v1/completions", json={
            "model": MODEL, "prompt": [5, 6, 7, 8], "truncate_prompt_tokens": keep})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)
        assert stack.engine.requests[-1].prompt_token_ids == want
    r = await stack.http.post("/v1/completions", json={
        "model": MODEL, "prompt": [5] * 300, "truncate_prompt_tokens": 10, "max_tokens": 2})
    assert r.status_code == 200  # over the context length before, not after


async def test_x_request_id_names_the_response(stack: Stack) -> None:
    """vLLM answers with the client's X-Request-Id; two requests may share one."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    headers = {"X-Request-Id": "abc123"}
    async with anyio.create_task_group() as tg:
        replies: list[httpx.Response] = []

        async def one() -> None:
            replies.append(await stack.http.post("/v1/chat/completions", json=body,
                                                 headers=headers))

        for _ in range(2):
            tg.start_soon(one)
    assert [r.json()["id"] for r in replies] == ["chatcmpl-abc123"] * 2
    engine_ids = [r.request_id for r in stack.engine.requests[-2:]]
    assert len(set(engine_ids)) == 2 and all("abc123" in i for i in engine_ids)
    r = await stack.http.post("/v1/completions", json={"model": MODEL, "prompt": [5]},
                              headers=headers)
    assert r.json()["id"] == "cmpl-abc123"


async def test_chat_stream_sse_format_with_usage(stack: Stack) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True,
               "stream_options": {"include_usage": True}}
    async with stack.http.stream("POST", "/v1/chat/completions", json=request) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events((await r.aread()).decode())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks[:-1])
    with_choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(ch["delta"].get("content", "") for ch in with_choices) == REPLY
    assert [ch["finish_reason"] for ch in with_choices][-1] == "stop"
    assert all(ch["finish_reason"] is None for ch in with_choices[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


async def test_completion_from_text_stops_at_max_tokens(stack: Stack, tokenizer: Tokenizer) -> None:
    r = await stack.http.post("/v1/completions", json={
        "model": MODEL, "prompt": "The capital", "max_tokens": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and "token_ids" not in choice
    assert choice["text"] == tokenizer.decode(tokenizer.encode(REPLY)[:5])
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert stack.engine.requests[0].prompt_token_ids == tokenizer.encode("The capital")


async def test_completion_token_ids_round_trip(stack: Stack, tokenizer: Tokenizer) -> None:
    expected_ids = [*tokenizer.encode(REPLY), tokenizer.backend.token_to_id("<|im_end|>")]
    request = {"model": MODEL, "prompt": [5, 6, 7], "return_token_ids": True, "max_tokens": 40}
    choice = (await stack.http.post("/v1/completions", json=request)).json()["choices"][0]
    assert (choice["prompt_token_ids"], choice["token_ids"]) == ([5, 6, 7], expected_ids)
    assert choice["text"] == REPLY  # the EOS token is reported in ids, not in text
    async with stack.http.stream("POST", "/v1/completions",
                                 json={**request, "stream": True}) as r:
        events = sse_events((await r.aread()).decode())
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert chunks[0]["prompt_token_ids"] == [5, 6, 7]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == expected_ids
    assert "".join(c["text"] for c in chunks) == REPLY
    assert chunks[-1]["finish_reason"] == "stop"


BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "x", "prompt": [1, 2', None),
    ("/v1/completions", b"[1, 2, 3]", None),
    ("/v1/completions", {"prompt": [5], "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": [5], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [5], "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": [5], "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": [5], "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": [5], "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": [5], "n": 0}, "n"),
    ("/v1/completions", {"prompt": [5], "n": 129}, "n"),
    ("/v1/completions", {"prompt": [5], "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": [5], "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": [5], "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": [5], "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": [5], "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": [5], "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": [5], "truncate_prompt_tokens": -2},
     "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": [5], "structured_outputs": {"structural_tag": "x"}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": [5], "structured_outputs": {}}, "structured_outputs"),
    ("/v1/completions", {"prompt": [5], "response_format": {"type": "structural_tag"}},
     "response_format"),
    ("/v1/completions", {"prompt": [5], "logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": [5], "logit_bias": {"400": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": [5], "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": [5], "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": [5], "allowed_token_ids": [400]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": [5], "stream": True, "prompt_logprobs": 1},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": [5], "stop": [1]}, "stop"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [5] * 300}, None),
    ("/v1/completions", {"prompt": [5], "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": [REJECT, 5]}, None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
]


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}
NOT_BUILT = [  # (path, fields, the field the 400 names)
    ("/v1/chat/completions", {"structural_tag": {"structures": []}}, "structural_tag"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"bad_words": ["x"]}, "bad_words"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/completions", {"tools": [TOOL]}, "tools"),
]
HARMLESS = [  # the same fields with values that change nothing: served
    ("/v1/chat/completions", {"response_format": {"type": "text"}, "tools": [TOOL],
                              "tool_choice": "none", "continue_final_message": False,
                              "echo": False, "functions": []}),
    ("/v1/chat/completions", {"tool_choice": "required", "tools": []}),  # (OpenAI, vLLM)
    ("/v1/completions", {"suffix": "", "bad_words": [], "use_beam_search": False,
                         "best_of": 1, "guided_json": None}),
]


async def test_fields_not_built_are_refused_unless_they_change_nothing(stack: Stack) -> None:
    """vLLM fields that would change the output (structured outputs, tools, beam search...)
    get a 400 naming them, not a 200 that ignored them."""
    for path, fields, param in NOT_BUILT:
        base = CHAT if "chat" in path else {"prompt": [5]}
        r = await stack.http.post(path, json={"model": MODEL, **base, **fields})
        error = error_of(r, 400, "BadRequestError")
        assert error["param"] == param and "not supported" in error["message"], error
    for path, fields in HARMLESS:
        base = CHAT if "chat" in path else {"prompt": [5]}
        r = await stack.http.post(path, json={"model": MODEL, **base, **fields})
        assert r.status_code == 200, r.text


async def test_bad_requests_get_openai_errors_then_service_continues(stack: Stack) -> None:
    for path, body, param in BAD_REQUESTS:
        if isinstance(body, bytes):
            r = await stack.http.post(path, content=body,
                                      headers={"content-type": "application/json"})
        else:
            r = await stack.http.post(path, json={"model": MODEL, **body})
        error = error_of(r, 400, "BadRequestError")
        assert error["param"] == param, (body, error)
    missing = await stack.http.post("/v1/completions", json={"model": "nope", "prompt": [5]})
    assert error_of(missing, 404, "NotFoundError")["message"] == "The model `nope` does not exist."
    error_of(await stack.http.get("/v1/nothing"), 404, "NotFoundError")
    not_allowed = await stack.http.get("/v1/completions")
    error_of(not_allowed, 405, "MethodNotAllowedError")
    assert not_allowed.headers["allow"] == "POST"  # RFC 9110
    r = await stack.http.post("/v1/completions", json={"model": MODEL, "prompt": [5],
                                                        "max_tokens": 40})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == REPLY


async def test_openai_client_and_models(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0)
    models = (await client.models.list()).data
    assert [m.id for m in models] == [MODEL] and models[0].max_model_len == 256
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    full = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=50)
    assert full.choices[0].message.content == REPLY
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=50, stream=True,
        stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert chunks[-1].usage == full.usage
    await client.close()


async def test_client_disconnect_mid_stream_aborts(stack: Stack) -> None:
    request = {"model": MODEL, "prompt": [HANG, 5], "stream": True}
    async with stack.http.stream("POST", "/v1/completions", json=request) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break  # leaving the block closes the connection with the stream unfinished
    with anyio.fail_after(5):
        await stack.engine.aborted.wait()
    assert stack.engine.aborts == [stack.engine.requests[0].request_id]


async def test_client_disconnect_during_non_streamed_request_aborts(stack: Stack) -> None:
    request = {"model": MODEL, "prompt": [HANG, 5]}
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(stack.http.post, "/v1/completions", json=request))
        with anyio.fail_after(5):
            await stack.engine.received.wait()
        tg.cancel_scope.cancel()  # the client gives up and closes its connection
    with anyio.fail_after(5):
        await stack.engine.aborted.wait()
    assert stack.engine.aborts == [stack.engine.requests[0].request_id]


async def test_engine_loss_fails_requests_and_health_until_reconnected(
        model_dir: Path, tokenizer: Tokenizer) -> None:
    """With no failover wait (`--failover-timeout 0`), a request whose only group is
    lost fails with 503 at once, as /health and new requests do until it is back."""
    eos = tokenizer.backend.token_to_id("<|im_end|>")
    async with FakeEngine(tokenizer.encode(REPLY), eos).running() as engine, \
            serve_gateway(model_dir, engine, failover_timeout_s=0.0) as stack:
        await _engine_loss(stack)


async def _engine_loss(stack: Stack) -> None:
    assert (await stack.http.get("/health")).status_code == 200
    request = {"model": MODEL, "prompt": [HANG, 5], "stream": True}
    async with stack.http.stream("POST", "/v1/completions", json=request) as r:
        lines = r.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                break
        stack.engine.accepting = False
        await stack.engine.drop_connections()
        rest = [line async for line in lines if line]
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == 503
    assert rest[-1] == "data: [DONE]"
    error_of(await stack.http.get("/health"), 503, "ServiceUnavailableError")
    down = await stack.http.post("/v1/completions", json={"model": MODEL, "prompt": [5]})
    error_of(down, 503, "ServiceUnavailableError")
    async with anyio.create_task_group() as tg:
        waiter_done = anyio.Event()

        async def wait_for_engine() -> None:
            await stack.client.wait_warm()  # connected again, and that connection warmed up
            waiter_done.set()

        tg.start_soon(wait_for_engine)
        with anyio.fail_after(5):
            for _ in range(2):  # the gateway keeps retrying while someone waits for it
                await stack.engine.next_refusal()
            stack.engine.accepting = True
            await waiter_done.wait()
    assert (await stack.http.get("/health")).status_code == 200
    assert len(stack.engine.warmups) == 2  # one per connection


async def test_checkpoint_without_tokenizer_serves_token_ids(tmp_path: Path) -> None:
    model_dir = tmp_path / "no-tokenizer"
    model_dir.mkdir()
    async with FakeEngine([40, 41], eos_id=2).running() as engine, \
            serve_gateway(model_dir, engine) as stack:
        chat = {"messages": [{"role": "user", "content": "x"}]}
        for path, body in [("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "hi"})]:
            r = await stack.http.post(path, json={"model": "no-tokenizer", **body})
            assert "no tokenizer" in error_of(r, 400, "BadRequestError")["message"]
        r = await stack.http.post("/v1/completions", json={
            "model": "no-tokenizer", "prompt": [5, 6], "return_token_ids": True})
        choice = r.json()["choices"][0]
        assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == ("", [40, 41, 2],
                                                                                 "stop")


async def test_python_m_gateway_reports_port_and_serves(model_dir: Path,
                                                        tokenizer: Tokenizer) -> None:
    eos = tokenizer.backend.token_to_id("<|im_end|>")
    read_end, write_end = os.pipe()
    async with FakeEngine(tokenizer.encode(REPLY), eos).running() as engine:
        process = await anyio.open_process(
            [sys.executable, "-m", "gateway", "--model", str(model_dir), "--engine",
             f"127.0.0.1:{engine.port}", "--port", "0", "--ready-fd", str(write_end)],
            pass_fds=[write_end], stdin=None, stdout=None, stderr=None)
        os.close(write_end)
        try:
            with anyio.fail_after(15):
                await anyio.wait_readable(read_end)
                port = int(os.read(read_end, 64).decode())
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                    while (await http.get("/health")).status_code != 200:
                        await anyio.sleep(0.02)  # polling readiness, bounded by fail_after
                    r = await http.post("/v1/chat/completions", json={
                        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
            assert r.json()["choices"][0]["message"]["content"] == REPLY
        finally:
            os.close(read_end)
            process.terminate()
            with anyio.move_on_after(10) as waited:
                code = await process.wait()
            if waited.cancelled_caught:
                process.kill()
                await process.wait()
                pytest.fail("the gateway did not stop within 10 s of SIGTERM")
            # uvicorn shuts down gracefully, then re-raises the signal it caught.
            assert code in (0, -signal.SIGTERM)


async def test_one_attention_group_down_leaves_the_others_serving(model_dir: Path,
                                                                  tokenizer: Tokenizer) -> None:
    """Two groups, one lost: requests go to the other; /health says not every group is up."""
    eos = tokenizer.backend.token_to_id("<|im_end|>")
    async with FakeEngine(tokenizer.encode(REPLY), eos).running() as first, \
            FakeEngine(tokenizer.encode(REPLY), eos).running() as second, \
            serve_gateway(model_dir, first, second) as stack:
        assert (await stack.http.get("/health")).status_code == 200
        second.accepting = False
        await second.drop_connections()
        with anyio.fail_after(5):
            while stack.client.all_connected:  # the gateway notices the loss
                await anyio.sleep(0.01)
        error_of(await stack.http.get("/health"), 503, "ServiceUnavailableError")
        for _ in range(3):
            r = await stack.http.post("/v1/completions", json={"model": MODEL, "prompt": [5]})
            assert r.status_code == 200, r.text
        assert len(first.requests) == 3 and not second.requests
        models = (await stack.http.get("/v1/models")).json()["data"][0]
        assert models["max_model_len"] == first.info.max_model_len


async def test_a_request_whose_choice_fails_to_start_gives_back_every_place(
        model_dir: Path, tokenizer: Tokenizer) -> None:
    """n = 2, the second choice's start fails (a connection lost between them): both
    places come back, so failures cannot fill the queue and turn everything into 429."""
    from starlette.requests import Request

    from common.messages import EngineInfo
    from gateway.api.protocol import CompletionRequest
    from gateway.api.serving import Serving
    from gateway.errors import GatewayError, engine_unavailable

    class Generation:
        async def aclose(self) -> None:
            """Nothing runs in the engine to abort."""

    class HalfUp:  # an engine pool that loses its connection on every second start
        info = EngineInfo("FakeMoE", 256, 400, (2,), "bf16", 16, 16, max_num_seqs=4)
        starts = 0

        def max_num_seqs(self) -> int:
            return 4

        async def start(self, request: object) -> Generation:
            self.starts += 1
            if self.starts % 2 == 0:
                raise engine_unavailable("lost the connection to the engine")
            return Generation()

    config = GatewayConfig(model_dir=model_dir, served_model_name=MODEL,
                           engines=(("127.0.0.1", 9),), max_queued_requests=0)
    serving = Serving(config, HalfUp(), tokenizer)  # type: ignore[arg-type]
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": []})
    for n in (2, 2, 2, 4):  # 4 places in all; the last asks for every one of them
        body = CompletionRequest(model=MODEL, prompt=[5], n=n, max_tokens=4)
        with pytest.raises(GatewayError) as failed:
            await serving.start(request, "cmpl", [5], body)
        assert failed.value.status == 503  # not 429: no place was lost


async def test_min_tokens_and_stop_strings_as_vllm(stack: Stack, tokenizer: Tokenizer) -> None:
    """min_tokens reaches the engine (which keeps EOS and stop ids out until then) and
    holds stop strings back until that many tokens; include_stop_str_in_output keeps the
    stop string; min_tokens above max_tokens is a 400."""
    ids = tokenizer.encode(REPLY)
    body = {"model": MODEL, "prompt": [5, 6], "stop": [","], "max_tokens": 40}
    cut = (await stack.http.post("/v1/completions", json=body)).json()["choices"][0]
    assert (cut["text"], cut["finish_reason"]) == (REPLY.split(",")[0], "stop")
    kept = (await stack.http.post("/v1/completions", json={
        **body, "include_stop_str_in_output": True})).json()["choices"][0]
    assert kept["text"] == REPLY.split(",")[0] + ","
    late = (await stack.http.post("/v1/completions", json={
        **body, "min_tokens": len(ids)})).json()["choices"][0]  # looked for at the end only
    assert (late["text"], late["finish_reason"]) == (REPLY, "stop")  # EOS ended it
    assert stack.engine.requests[-1].sampling.min_tokens == len(ids)
    # vLLM's rule: a stop string must end in a token after the first min_tokens; it may
    # start in them. The comma's own token is within min_tokens = its position: no stop.
    texts = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    comma = next(k for k, t in enumerate(texts) if "," in t)  # tokens up to the comma
    at_comma = (await stack.http.post("/v1/completions", json={
        **body, "min_tokens": comma})).json()["choices"][0]
    assert (at_comma["text"], at_comma["finish_reason"]) == (REPLY, "stop")  # EOS ended it
    span = "lo, w"  # from the protected tokens into the first one after them
    ends = next(k for k, t in enumerate(texts) if span in t)
    assert span not in texts[ends - 1] and len(texts[ends - 1]) > REPLY.index(span)
    straddling = (await stack.http.post("/v1/completions", json={
        **body, "stop": [span], "min_tokens": ends - 1})).json()["choices"][0]
    assert (straddling["text"], straddling["finish_reason"]) == ("Hel", "stop")
    error = error_of(await stack.http.post("/v1/completions", json={
        **body, "min_tokens": 41}), 400, "BadRequestError")
    assert error["message"] == "min_tokens must be less than or equal to max_tokens=40, got 41."
    assert error["param"] == "min_tokens"


async def test_openai_and_vllm_request_conventions(stack: Stack, tokenizer: Tokenizer) -> None:
    """null is "not given" (the openai client sends None); vLLM's refusals of
    stream_options without stream and of top_logprobs without logprobs; a text
    completion without max_tokens gets 16 tokens."""
    ids = tokenizer.encode(REPLY)
    nulls = await stack.http.post("/v1/completions", json={
        "model": MODEL, "prompt": [5], "n": None, "stream": None, "echo": None,
        "logprobs": None, "max_tokens": None, "stop": None})
    assert nulls.status_code == 200, nulls.text
    choice = nulls.json()["choices"][0]
    assert choice["text"] == tokenizer.decode(ids[:16]) and choice["finish_reason"] == "length"
    assert nulls.json()["usage"]["completion_tokens"] == 16
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for path, body, message in [
            ("/v1/completions", {"model": MODEL, "prompt": [5],
                                 "stream_options": {"include_usage": True}},
             "Stream options can only be defined when `stream=True`."),
            ("/v1/completions", {"model": MODEL, "prompt": [5],
                                 "stream_options": {"include_usage": False}},
             "Stream options can only be defined when `stream=True`."),
            ("/v1/chat/completions", {**chat, "top_logprobs": 2},
             "when using `top_logprobs`, `logprobs` must be set to true.")]:
        error = error_of(await stack.http.post(path, json=body), 400, "BadRequestError")
        assert message in error["message"]
    r = await stack.http.post("/v1/chat/completions", json={**chat, "top_logprobs": 0})
    assert r.status_code == 200  # 0 alternatives without logprobs is allowed, as in vLLM
    r = await stack.http.post("/v1/chat/completions", json={**chat, "stream_options": {}})
    assert r.status_code == 200  # an empty dict sets nothing: vLLM accepts it too


async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(stack: Stack
                                                                          ) -> None:
    """vLLM's: each chunk carries its choice's usage so far; the last, the request's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for path, body in [("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "Hi"}], "n": 2}),
                       ("/v1/completions", {"prompt": [[5, 6], [5, 6, 7]]})]:
        async with stack.http.stream("POST", path, json={
                "model": MODEL, **body, "stream": True, "stream_options": options}) as r:
            chunks = [json.loads(e) for e in sse_events((await r.aread()).decode())[:-1]]
        per_choice: dict[int, list[dict]] = {}
        for c in chunks[:-1]:
            per_choice.setdefault(c["choices"][0]["index"], []).append(c["usage"])
        assert sorted(per_choice) == [0, 1]
        for usages in per_choice.values():
            used = [u["completion_tokens"] for u in usages]
            assert used == sorted(used) and used[-1] > 0, used
            assert len({u["prompt_tokens"] for u in usages}) == 1
        total = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == []
        assert total["completion_tokens"] == sum(u[-1]["completion_tokens"]
                                                 for u in per_choice.values())
        if "prompt" in body:  # each choice counts its own prompt
            assert [per_choice[i][0]["prompt_tokens"] for i in (0, 1)] == [2, 3]


async def test_include_stop_str_in_output_keeps_a_stop_tokens_text(stack: Stack,
                                                                    tokenizer: Tokenizer
                                                                    ) -> None:
    """vLLM drops a stop token's text unless include_stop_str_in_output."""
    ids = tokenizer.encode(REPLY)
    stop = ids[2]  # the engine ends at it: a stop token id
    assert stop not in ids[:2]
    body = {"model": MODEL, "prompt": [5], "max_tokens": 40, "stop_token_ids": [stop]}
    dropped = (await stack.http.post("/v1/completions", json=body)).json()["choices"][0]
    kept = (await stack.http.post("/v1/completions", json={
        **body, "include_stop_str_in_output": True})).json()["choices"][0]
    assert dropped["text"] == tokenizer.decode(ids[:2])
    assert kept["text"] == tokenizer.decode(ids[:3])


async def test_a_choice_cut_by_a_stop_string_is_aborted_at_once(tokenizer: Tokenizer) -> None:
    """With n > 1 the run closes only after its slowest choice: a choice that hit a stop
    string must release its engine request itself, then and there."""
    from common.messages import TokenDelta
    from gateway.api.output import StopStrings, outputs
    from gateway.observability.metrics import Metrics, RequestTimer
    from gateway.text.detokenizer import IncrementalDetokenizer

    class Generation:
        closed, arrived = False, None

        def __init__(self, ids: list[int]) -> None:
            self._deltas = iter([TokenDelta("r", [i]) for i in ids])

        def __aiter__(self) -> Generation:
            return self

        async def __anext__(self) -> TokenDelta:
            try:
                return next(self._deltas)
            except StopIteration:
                raise StopAsyncIteration from None

        async def aclose(self) -> None:
            self.closed = True

    generation = Generation(tokenizer.encode(REPLY))
    steps = outputs(generation, IncrementalDetokenizer(tokenizer), (), StopStrings([","]),
                    RequestTimer(Metrics(MODEL)))
    texts = [step async for step in steps]
    assert texts[-1].finish_reason == "stop" and "".join(t.text for t in texts) == "Hello"
    assert generation.closed


async def test_n_beyond_the_servers_capacity_is_a_400(model_dir: Path,
                                                                     tokenizer: Tokenizer
                                                                     ) -> None:
    """n above what the server runs or queues at once is a 400, not a 429 to retry for
    ever."""
    from starlette.requests import Request

    from common.messages import EngineInfo
    from gateway.api.protocol import CompletionRequest
    from gateway.api.serving import Serving
    from gateway.errors import GatewayError

    class Pool:
        info = EngineInfo("FakeMoE", 256, 400, (2,), "bf16", 16, 16, max_num_seqs=4)

        def max_num_seqs(self) -> int:
            return 4

    config = GatewayConfig(model_dir=model_dir, served_model_name=MODEL,
                           engines=(("127.0.0.1", 9),), max_queued_requests=2)
    serving = Serving(config, Pool(), tokenizer)  # type: ignore[arg-type]
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": []})
    with pytest.raises(GatewayError) as refused:
        await serving.start(request, "cmpl", [5], CompletionRequest(prompt=[5], n=7))
    assert (refused.value.status, refused.value.param) == (400, "n")
    assert "more than this server runs or queues at once (6)" in refused.value.message
    assert serving.admission.admitted == 0
    # a batch of prompts is counted whole, before any of its requests starts
    from gateway.api.completions import _start

    body = CompletionRequest(prompt=[[5]] * 4, n=2)
    with pytest.raises(GatewayError) as refused:
        await _start(serving, request, body, [[5]] * 4)
    assert (refused.value.status, refused.value.param) == (400, "n")
    assert refused.value.message.startswith("4 prompts x n=2 is more than")
    serving.admission.admitted = 3  # room for 3 now: a batch of 4 gets a 429 without starting any
    with pytest.raises(GatewayError) as busy:
        await _start(serving, request, CompletionRequest(prompt=[[5]] * 4), [[5]] * 4)
    assert busy.value.status == 429 and serving.admission.admitted == 3


async def test_echo_of_token_ids_without_a_tokenizer_takes_no_place(tmp_path: Path) -> None:
    model_dir = tmp_path / "no-tokenizer"
    model_dir.mkdir()
    async with FakeEngine([40, 41], eos_id=2).running() as engine, \
            serve_gateway(model_dir, engine) as stack:
        for _ in range(3):
            r = await stack.http.post("/v1/completions", json={
                "model": "no-tokenizer", "prompt": [5, 6], "echo": True})
            assert "no tokenizer" in error_of(r, 400, "BadRequestError")["message"]
        assert engine.requests == []  # nothing started, nothing left running


TOOLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
    "{% if documents %}docs: {% for d in documents %}{{ d.title }} {% endfor %}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


async def test_tools_documents_and_special_tokens_reach_the_prompt_as_transformers_writes_it(
        tmp_path: Path) -> None:
    """With `tool_choice: "none"` the tools, and `documents`, are template variables (vLLM,
    transformers' apply_chat_template); `add_special_tokens` adds the tokenizer's BOS."""
    model_dir = write_checkpoint(tmp_path / "tools", TOOLS_TEMPLATE, add_bos=True)
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    documents = [{"title": "Paris", "text": "Capital of France."}]
    async with FakeEngine([40, 41], eos_id=2).running() as engine, \
            serve_gateway(model_dir, engine) as stack:
        async def prompt(body: dict[str, Any], path: str = "/v1/chat/completions"
                         ) -> list[int]:
            r = await stack.http.post(path, json={"model": "tools", **body})
            assert r.status_code == 200, r.text
            return engine.requests[-1].prompt_token_ids

        want = hf.apply_chat_template(messages, tools=tools, documents=documents,
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        assert "lookup" in hf.decode(want) and "Paris" in hf.decode(want)
        got = await prompt({"messages": messages, "tools": tools, "tool_choice": "none",
                            "documents": documents})
        assert got == want
        tokenized = await stack.http.post("/tokenize", json={
            "messages": messages, "tools": tools, "documents": documents})
        assert tokenized.json()["tokens"] == want
        bos = hf.convert_tokens_to_ids("<s>")
        assert bos == HANG  # the fake engine holds such a prompt: read its first token only

        async def held(body: dict[str, Any], path: str) -> list[int]:
            async with stack.http.stream("POST", path, json={
                    "model": "tools", **body, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():  # to the engine's token (after a role)
                    if line.startswith("data:") and "role" not in line:
                        break
            return engine.requests[-1].prompt_token_ids

        assert await held({"messages": messages, "add_special_tokens": True},
                          "/v1/chat/completions") == \
            [bos, *hf.apply_chat_template(messages, add_generation_prompt=True,
                                          tokenize=True, return_dict=False)]
        text = await prompt({"prompt": "Paris", "add_special_tokens": False}, "/v1/completions")
        assert text == hf.encode("Paris", add_special_tokens=False) and text[0] != bos
        assert await held({"prompt": "Paris"}, "/v1/completions") == [bos, *text]


async def test_stop_reason_names_a_models_other_eos_ids(model_dir: Path,
                                                        tokenizer: Tokenizer) -> None:
    """vLLM: the tokenizer's EOS ends a choice with stop_reason None, the model's other EOS
    ids (generation_config.json's) and the request's stop ids name themselves."""
    import msgspec

    ids = tokenizer.encode(REPLY)
    eos = tokenizer.backend.token_to_id("<|im_end|>")
    extra = ids[3]
    assert extra not in ids[:3] and tokenizer.eos_token_id == eos
    engine = FakeEngine(ids, eos)
    engine.info = msgspec.structs.replace(engine.info, eos_token_ids=(eos, extra))
    async with engine.running(), serve_gateway(model_dir, engine) as stack:
        body = {"model": MODEL, "prompt": [5], "max_tokens": 40}
        choice = (await stack.http.post("/v1/completions", json=body)).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == extra
        ignoring = (await stack.http.post("/v1/completions", json={
            **body, "ignore_eos": True, "stop_token_ids": [ids[1]]})).json()["choices"][0]
        assert ignoring["stop_reason"] == ids[1]
    plain = FakeEngine(ids[:2], eos)
    async with plain.running(), serve_gateway(model_dir, plain) as stack:
        choice = (await stack.http.post("/v1/completions", json=body)).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None


async def test_the_mistral_parser_reads_its_special_token_which_skipping_would_drop(
        tmp_path: Path) -> None:
    """Mixtral 8x22B writes calls after the special token [TOOL_CALLS]; with auto tool
    choice and --tool-call-parser mistral the text keeps special tokens (vLLM's
    adjust_request), so the call is found; the ids fit Mistral's templates (9 alnum)."""
    model_dir = write_checkpoint(tmp_path / "mixtral-like")
    backend = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
    backend.add_special_tokens(["[TOOL_CALLS]"])
    backend.save(str(model_dir / "tokenizer.json"))
    tokenizer = Tokenizer.load(model_dir)
    assert tokenizer is not None
    token = backend.token_to_id("[TOOL_CALLS]")
    reply = [*tokenizer.encode("Sure.", False), token,
             *tokenizer.encode(' [{"name": "f", "arguments": {"a": 1}}]', False)]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    chat = {"model": model_dir.name, "messages": [{"role": "user", "content": "Hi"}]}
    eos = backend.token_to_id("<|im_end|>")
    async with FakeEngine(reply, eos).running() as engine, \
            serve_gateway(model_dir, engine, tool_call_parser="mistral",
                          enable_auto_tool_choice=True) as stack:
        r = await stack.http.post("/v1/chat/completions", json={**chat, "tools": [tool]})
        assert engine.requests[-1].prompt_token_ids  # (the fake replies whatever it gets)
        choice = r.json()["choices"][0]
        [call] = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "f", "arguments": '{"a": 1}'}
        assert len(call["id"]) == 9 and call["id"].isalnum()
        assert (choice["message"]["content"], choice["finish_reason"]) == ("Sure.",
                                                                          "tool_calls")
        # Without tools the token is skipped, as usual: a parser reading text would miss it
        r = await stack.http.post("/v1/chat/completions", json=chat)
        assert r.json()["choices"][0]["message"]["content"] == \
            'Sure. [{"name": "f", "arguments": {"a": 1}}]'
