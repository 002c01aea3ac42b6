"""`switchyard bench` against a fake OpenAI-compatible server: output tokens are counted
from `token_ids` where the server sends them (Switchyard), else from the final usage chunk
of `stream_options.include_usage`, else one per text chunk (as `vllm bench serve` does);
each failure is counted by its cause; a request whose kept-alive connection the server
closed is sent again."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import closing, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from switchyard import bench
from switchyard.bench import make_prompts, percentile, split_load
from tests.support.tools import wait_until

pytestmark = pytest.mark.timeout(120)

INPUT_LEN, OUTPUT_LEN, PROMPTS = 5, 6, 4


@dataclass
class FakeServer:
    """Streams `max_tokens` tokens in chunks of `per_chunk` tokens (cycled), as text and,
    with `token_ids`, as ids; with `usage` (and include_usage asked) a final usage chunk
    reports `max_tokens + usage_error` completion tokens."""

    per_chunk: tuple[int, ...]
    token_ids: bool = False
    usage: bool = True
    usage_error: int = 0
    fail_every: int = 0  # every n-th request (the warm-up is the first) answered with a 500
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/models", self.models),
            Route("/v1/completions", self.completions, methods=["POST"])])

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(self, request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return JSONResponse({"error": "overloaded"}, status_code=500)
        return StreamingResponse(self.events(body), media_type="text/event-stream")

    async def events(self, body: dict[str, Any]) -> AsyncIterator[str]:
        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            return "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion",
                                          "model": "fake", "choices": choices,
                                          "usage": usage}) + "\n\n"

        left, sizes = body["max_tokens"], itertools.cycle(self.per_chunk)
        while left:
            await asyncio.sleep(0.002)  # the time a token takes: TPOT and ITL are > 0
            n = min(next(sizes), left)
            left -= n
            choice = {"index": 0, "text": " tok" * n, "finish_reason": None}
            if self.token_ids:
                choice["token_ids"] = list(range(n))
            yield chunk([choice])
        yield chunk([{"index": 0, "text": "", "finish_reason": "length"}])  # as vLLM ends
        if self.usage and (body.get("stream_options") or {}).get("include_usage"):
            done = body["max_tokens"] + self.usage_error
            yield chunk([], {"prompt_tokens": len(body["prompt"]), "completion_tokens": done,
                             "total_tokens": len(body["prompt"]) + done})
        yield "data: [DONE]\n\n"


@contextmanager
def serving(fake: FakeServer) -> Iterator[str]:
    """`fake` on a loopback port (its socket bound here: no race for it), in a thread."""
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 30, lambda: "uvicorn up")
        assert server.started, "the fake server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
        assert not thread.is_alive(), "the fake server did not stop"


def run_bench(url: str, tmp_path: Path) -> tuple[int, list[dict[str, Any]]]:
    """`switchyard bench --url URL ...` by its entry point: exit status and JSON reports."""
    out = tmp_path / "reports.json"
    status = bench.main(["--url", url, "--concurrency", "1", "2", "--num-prompts",
                         str(PROMPTS), "--input-len", str(INPUT_LEN), "--output-len",
                         str(OUTPUT_LEN), "--client-processes", "2", "--json", str(out)])
    return status, json.loads(out.read_text()) if out.exists() else []


@pytest.mark.parametrize("fake", [
    # vLLM, SGLang, OpenAI: text only, several tokens in some chunks; the usage chunk counts
    FakeServer(per_chunk=(1, 3, 2)),
    # no usage chunk: one token per text chunk, which is right where each chunk holds one
    FakeServer(per_chunk=(1,), usage=False),
    # Switchyard: token ids in the chunks, with and without the usage chunk
    FakeServer(per_chunk=(2, 1, 3), token_ids=True),
    FakeServer(per_chunk=(2, 1, 3), token_ids=True, usage=False),
], ids=["text+usage", "text-one-per-chunk", "token_ids+usage", "token_ids"])
def test_output_tokens_are_counted_with_or_without_token_ids(fake: FakeServer,
                                                             tmp_path: Path) -> None:
    with serving(fake) as url:
        status, reports = run_bench(url, tmp_path)
    assert status == 0, reports
    assert len(fake.bodies) == 1 + 2 * PROMPTS  # the warm-up, then two levels
    assert all(b["stream_options"] == {"include_usage": True} and b["stream"]
               and b["max_tokens"] == OUTPUT_LEN for b in fake.bodies)
    for r in reports:
        assert (r["completed"], r["failed"], r["errors"]) == (PROMPTS, 0, [])
        duration = r["duration_s"]
        assert r["output_throughput"] == pytest.approx(PROMPTS * OUTPUT_LEN / duration)
        assert r["total_token_throughput"] == pytest.approx(
            PROMPTS * (INPUT_LEN + OUTPUT_LEN) / duration)
        # TPOT = (e2e - TTFT) / (output tokens - 1) per request: the counted tokens, not
        # the chunks (3 of them for 6 tokens in the text+usage case)
        assert r["tpot"]["mean_ms"] > 0
        assert r["tpot"]["mean_ms"] == pytest.approx(
            (r["e2e"]["mean_ms"] - r["ttft"]["mean_ms"]) / (OUTPUT_LEN - 1))


@pytest.mark.parametrize(("fake", "got"), [
    # no usage chunk and several tokens a chunk: the 3 chunks are all that can be counted
    (FakeServer(per_chunk=(1, 3, 2), usage=False), 3),
    # the usage chunk has the last word, over the ids counted in the chunks
    (FakeServer(per_chunk=(1,), token_ids=True, usage_error=-1), OUTPUT_LEN - 1),
], ids=["text-no-usage", "usage-says-fewer"])
def test_a_short_count_fails_the_request_saying_what_it_got(
        fake: FakeServer, got: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
        ) -> None:
    with serving(fake) as url:
        status, reports = run_bench(url, tmp_path)
    assert (status, reports) == (1, [])  # the warm-up request stops the run
    assert (f"the warm-up request failed: got {got} of {OUTPUT_LEN} tokens"
            in capsys.readouterr().err)


@pytest.mark.parametrize("fake", [FakeServer(per_chunk=(2,), token_ids=True, fail_every=2)],
                         ids=["every-second-a-500"])
def test_each_failure_is_counted_by_its_cause(fake: FakeServer, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A server that answers every second request with a 500: each level counts those
    failures by their cause (the status and the body's start), and the table says so."""
    with serving(fake) as url:
        status, reports = run_bench(url, tmp_path)
    assert status == 1
    cause = "HTTP 500: b'{\"error\":\"overloaded\"}'"
    for r in reports:
        assert r["failed"] == PROMPTS // 2 and r["failures"] == {cause: PROMPTS // 2}
        assert r["completed"] == PROMPTS - r["failed"]
    assert f"concurrency 2: {PROMPTS // 2} x {cause}" in capsys.readouterr().out


class DroppingServer:
    """An HTTP/1.1 server that answers the first request of each connection and closes
    the connection, unanswered, when a second one arrives on it: what a server that
    closes used keep-alive connections (llama.cpp's, after its keep-alive timeout) does
    to a client that sent its next request before the close reached it."""

    def __init__(self) -> None:
        self.requests = self.dropped = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # the client closing its connection (at the end of the run) ends the handler
        with closing(writer), suppress(asyncio.IncompleteReadError, ConnectionError):
            served = False
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                body = await reader.readexactly(int(length.group(1))) if length else b""
                if served:
                    self.dropped += 1
                    return
                served, self.requests = True, self.requests + 1
                writer.write(self.answer(head, body))
                await writer.drain()

    def answer(self, head: bytes, body: bytes) -> bytes:
        if head.startswith(b"GET /v1/models"):
            kind, payload = b"application/json", json.dumps(
                {"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode()
        else:
            n = json.loads(body)["max_tokens"]
            chunks = [{"choices": [{"index": 0, "text": " tok", "token_ids": [i],
                                    "finish_reason": None}]} for i in range(n)]
            kind = b"text/event-stream"
            payload = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
            payload += b"data: [DONE]\n\n"
        return (b"HTTP/1.1 200 OK\r\nContent-Type: " + kind + b"\r\nContent-Length: "
                + str(len(payload)).encode() + b"\r\n\r\n" + payload)


def test_a_request_whose_kept_alive_connection_the_server_closed_is_sent_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    server = DroppingServer()
    loop = asyncio.new_event_loop()
    listening = loop.run_until_complete(asyncio.start_server(server.handle, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
        status, reports = run_bench(url, tmp_path)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        listening.close()
        loop.close()
    assert status == 0, reports
    assert server.dropped > 0
    assert all(r["completed"] == PROMPTS and r["failed"] == 0 for r in reports)
    assert sum(r["retried"] for r in reports) == server.dropped
    assert "sent again after the server closed their kept-alive connection" in \
        capsys.readouterr().out


def test_prompts_are_fixed_by_the_seed_and_share_their_prefix() -> None:
    a = make_prompts(5, 20, 0.5, 100, seed=1)
    assert a == make_prompts(5, 20, 0.5, 100, seed=1) != make_prompts(5, 20, 0.5, 100, seed=2)
    assert all(len(p) == 20 and p[:10] == a[0][:10] for p in a)
    assert len({tuple(p[10:]) for p in a}) == 5


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=300),
       st.sampled_from([50, 90, 99, 99.9]))
def test_percentiles_are_numpys(values: list[float], q: float) -> None:
    """vllm bench serve reports numpy's percentiles; p99 of 100 values is not their max."""
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)),
                                                  rel=1e-12, abs=1e-9)
    assert percentile([float(i) for i in range(1, 101)], 99) == pytest.approx(99.01)


@given(st.integers(1, 40), st.integers(1, 8), st.integers(1, 200))
def test_load_is_split_in_proportion_to_each_process_share(concurrency: int, processes: int,
                                                           n: int) -> None:
    prompts = [[i] for i in range(n)]
    parts = split_load(prompts, concurrency, 10.0, processes)
    assert sorted(p for part, _, _ in parts for p in part) == prompts  # each prompt once
    assert sum(share for _, share, _ in parts) == concurrency
    assert sum(rate or 0 for _, _, rate in parts) == pytest.approx(10.0)
    for part, share, rate in parts:
        # the prompts per slot of concurrency differ by at most one between processes
        assert abs(len(part) - n * share / concurrency) <= share
        assert rate == pytest.approx(10.0 * share / concurrency)
