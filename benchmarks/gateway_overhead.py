""".venv/bin/python -m benchmarks.gateway_overhead [--rate 200] [--duration 10]
    [--concurrency 32] [--stream-tokens 2000] [--streams 1 4] [--json FILE]

What the HTTP gateway adds: the real gateway in front of a fake engine that answers at once.

Three processes (plus the client's): a fake engine speaking the engine's RPC protocol
(`InfoRequest` -> `EngineInfo`; every `GenerateRequest` answered at once with max_tokens
`TokenDelta`s, the last finishing with "length"), `python -m gateway` over the bundled demo
model's tokenizer in front of it, and the load generator in its own process. Measured:

1. short non-streamed /v1/completions (token-id prompt, max_tokens 1) at a fixed arrival
   rate (open loop, uniform spacing) and closed loop at a fixed number in flight: achieved
   requests/s and latency percentiles. The same load sent straight to the fake engine over
   RPC is the baseline, so the difference is what the gateway adds (HTTP parsing,
   validation, tokenizer-free request building, the multiplexed engine connection, JSON);
2. streamed chunk throughput: streams of --stream-tokens tokens, one token per SSE chunk,
   against the fake engine's own delta rate over RPC.

Latencies include the client's own cost: a minimal HTTP/1.1 keep-alive client (httpx
spends about as much CPU per request as the gateway, which would hide what we measure), or
msgspec framing for the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio
import httpx
from anyio.abc import SocketAttribute, SocketStream

from common.auth import NO_SECRET
from common.messages import (
    AbortRequest,
    EngineInfo,
    EngineStats,
    GenerateRequest,
    InfoRequest,
    Message,
    SamplingParams,
    StatsRequest,
    TokenDelta,
)
from common.rpc import FrameStream, accept, connect, serve_messages
from switchyard.bench import percentile
from switchyard.demo_model import DEFAULT_MODEL

log = logging.getLogger("fake-engine")

PROMPT = [87, 104, 97, 116, 32, 105, 115]  # "What is" in the demo's byte-level vocabulary
DIGITS = list(range(48, 58))  # streamed tokens: "0".."9", one character per chunk
INFO = EngineInfo("FakeEngine", max_model_len=8192, vocab_size=261, eos_token_ids=(260,),
                  dtype="float32", num_kv_blocks=1024, block_size=16)


# The fake engine.

async def _answer(frames: FrameStream, message: Message) -> None:
    if isinstance(message, InfoRequest):
        await frames.send(INFO)
    elif isinstance(message, GenerateRequest):
        n = message.sampling.max_tokens
        for i, token in zip(range(n), itertools.cycle(DIGITS)):
            await frames.send(TokenDelta(message.request_id, [token],
                                         "length" if i == n - 1 else None,
                                         len(message.prompt_token_ids)))
    elif isinstance(message, StatsRequest):
        await frames.send(EngineStats(0, 0, 0, INFO.num_kv_blocks, 0, []))
    elif not isinstance(message, AbortRequest):  # nothing is ever running to abort
        log.warning("unexpected %s", type(message).__name__)


async def _serve_connection(stream: SocketStream) -> None:
    frames = await accept(stream, NO_SECRET, "the gateway", log)
    if frames is None:
        return
    await serve_messages(frames, lambda message: _answer(frames, message), log)


async def _fake_engine(ready: mp.Queue) -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    ready.put(listener.extra(SocketAttribute.local_port))
    await listener.serve(_serve_connection)


def fake_engine_process(ready: mp.Queue) -> None:
    anyio.run(_fake_engine, ready)


# The gateway.

def start_gateway(engine_port: int) -> tuple[subprocess.Popen, str]:
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--model", str(DEFAULT_MODEL),
         "--engine", f"127.0.0.1:{engine_port}", "--port", "0", "--ready-fd", str(write_fd)],
        pass_fds=(write_fd,))
    os.close(write_fd)
    with os.fdopen(read_fd) as ready:
        port = int(ready.readline())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/health").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway did not connect to the fake engine")
        time.sleep(0.1)
    return proc, url


# Load generators (each runs in its own client process).

@dataclass
class Sample:
    """What one load run saw: completed requests (or received chunks), latencies (or gaps
    between chunks) in seconds."""

    count: int
    latencies: list[float]
    failed: int
    duration_s: float
    errors: list[str]


class RpcClient:
    """Requests straight to the engine over one multiplexed connection, as the gateway does."""

    def __init__(self, frames: FrameStream) -> None:
        self.frames = frames
        self.waiting: dict[str, tuple[anyio.Event, list[TokenDelta]]] = {}
        self.ids = itertools.count()

    async def read(self) -> None:
        while True:
            delta = await self.frames.receive()
            assert isinstance(delta, TokenDelta)
            done, deltas = self.waiting[delta.request_id]
            deltas.append(delta)
            if delta.finish_reason is not None:
                done.set()

    async def generate(self, max_tokens: int) -> int:
        rid = f"rpc-{next(self.ids)}"
        done, deltas = self.waiting[rid] = (anyio.Event(), [])
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        await self.frames.send(GenerateRequest(rid, PROMPT, params))
        await done.wait()
        del self.waiting[rid]
        return sum(len(d.token_ids) for d in deltas)


class Http:
    """A minimal HTTP/1.1 client over keep-alive connections (one request at a time each)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: object) -> AsyncIterator[tuple[int, bytes]]:
        """(status, piece of the body) as the pieces arrive: one for a sized body, one per
        HTTP chunk for a streamed one. Iterate to the end, or the connection is dropped."""
        if self.idle:
            reader, writer = self.idle.pop()
        else:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        payload = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type: "
                     f"application/json\r\ncontent-length: {len(payload)}\r\n\r\n".encode()
                     + payload)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        status = int(head[9:12])
        if "transfer-encoding: chunked" in head:
            while size := int(await reader.readline(), 16):
                yield status, await reader.readexactly(size)
                await reader.readexactly(2)
            await reader.readexactly(2)
        else:
            length = re.search(r"content-length: (\d+)", head)
            yield status, await reader.readexactly(int(length.group(1)) if length else 0)
        self.idle.append((reader, writer))

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


async def _http_one(http: Http) -> None:
    async for status, body in http.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1}):
        if status != 200 or json.loads(body)["choices"][0]["finish_reason"] != "length":
            raise RuntimeError(f"HTTP {status}: {body[:200]!r}")


async def _drive(target: str, rate: float | None, concurrency: int, duration: float
                 ) -> Sample:
    """Open loop at `rate` requests/s (uniform arrivals), or closed loop with `concurrency`
    requests in flight; against the gateway (`target` a URL) or the engine ("rpc:PORT")."""
    latencies: list[float] = []
    errors: list[str] = []
    http = Http(target)
    async with anyio.create_task_group() as tg:
        rpc: RpcClient | None = None
        if target.startswith("rpc:"):
            rpc = RpcClient(await connect("127.0.0.1", int(target[4:])))
            tg.start_soon(rpc.read)

        async def request() -> None:
            if rpc is not None:
                await rpc.generate(1)
            else:
                await _http_one(http)

        async def timed() -> None:
            start = time.perf_counter()
            try:
                await request()
                latencies.append(time.perf_counter() - start)
            except Exception as exc:
                errors.append(repr(exc))

        await request()  # warm the connection(s) up
        start = time.perf_counter()
        async with anyio.create_task_group() as load:
            if rate is not None:
                for i in range(int(rate * duration)):
                    await anyio.sleep(max(0.0, start + i / rate - time.perf_counter()))
                    load.start_soon(timed)
            else:
                async def worker() -> None:
                    while time.perf_counter() - start < duration:
                        await timed()
                for _ in range(concurrency):
                    load.start_soon(worker)
        elapsed = time.perf_counter() - start
        http.close()
        tg.cancel_scope.cancel()
    return Sample(len(latencies), latencies, len(errors), elapsed, sorted(set(errors))[:3])


async def _stream(target: str, streams: int, tokens: int) -> Sample:
    """`streams` concurrent streams of `tokens` tokens; latencies are the gaps between
    HTTP chunks (each carries one SSE event unless the gateway coalesced them)."""
    gaps: list[float] = []
    chunks = 0
    errors: list[str] = []
    body = {"prompt": PROMPT, "max_tokens": tokens, "stream": True}
    http = Http(target)

    async def one() -> None:
        nonlocal chunks
        last = time.perf_counter()
        async for status, piece in http.post("/v1/completions", body):
            if status != 200 or b'"error"' in piece:
                errors.append(f"HTTP {status}: {piece[:200]!r}")
            if events := piece.count(b"data: {"):
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
                chunks += events

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(streams):
            tg.start_soon(one)
    elapsed = time.perf_counter() - start
    http.close()
    if chunks != streams * tokens:
        errors.append(f"got {chunks} chunks, expected {streams * tokens}")
    return Sample(chunks, gaps, len(errors), elapsed, errors[:3])


async def _rpc_stream(port: int, streams: int, tokens: int) -> Sample:
    """The same streams straight from the engine: how fast its deltas can arrive at all."""
    counts: list[int] = []
    async with anyio.create_task_group() as tg:
        rpc = RpcClient(await connect("127.0.0.1", port))
        tg.start_soon(rpc.read)

        async def one() -> None:
            counts.append(await rpc.generate(tokens))

        start = time.perf_counter()
        async with anyio.create_task_group() as load:
            for _ in range(streams):
                load.start_soon(one)
        elapsed = time.perf_counter() - start
        tg.cancel_scope.cancel()
    failed = int(sum(counts) != streams * tokens)
    return Sample(sum(counts), [], failed, elapsed, [])


def _client(job: tuple[str, tuple]) -> dict:
    kind, args = job
    runner = {"drive": _drive, "stream": _stream, "rpc_stream": _rpc_stream}[kind]
    return asdict(asyncio.run(runner(*args)))


def in_client_process(kind: str, *args: object) -> Sample:
    """Run one load in a fresh process, so the client never shares the gateway's loop."""
    with mp.get_context("spawn").Pool(1) as pool:
        return Sample(**pool.apply(_client, ((kind, args),)))


# Reporting.

def _ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    return f"{1e3 * percentile(values, 100 * q):.2f}"


def request_row(name: str, mode: str, offered: str, s: Sample) -> str:
    achieved = s.count / s.duration_s
    return (f"| {name} | {mode} | {offered} | {achieved:.1f} | {s.count} | {s.failed} "
            f"| {_ms(s.latencies, 0.5)} | {_ms(s.latencies, 0.99)} | {_ms(s.latencies, 1.0)} |")


def stream_row(name: str, streams: int, tokens: int, s: Sample) -> str:
    rate = s.count / s.duration_s
    return (f"| {name} | {streams} | {tokens} | {s.count} | {s.duration_s:.2f} | {rate:.0f} "
            f"| {rate / streams:.0f} | {_ms(s.latencies, 0.5)} | {_ms(s.latencies, 0.99)} "
            f"| {s.failed} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=200.0, help="open-loop requests/s")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per open-loop run")
    ap.add_argument("--closed-duration", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=32, help="closed-loop requests in flight")
    ap.add_argument("--stream-tokens", type=int, default=2000)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--json", help="also write the raw samples' summaries here")
    args = ap.parse_args(argv)

    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    engine = ctx.Process(target=fake_engine_process, args=(ready,), daemon=True)
    engine.start()
    engine_port = ready.get(timeout=30)
    gateway, url = start_gateway(engine_port)
    rpc = f"rpc:{engine_port}"
    try:
        print(f"gateway {url}, fake engine 127.0.0.1:{engine_port}, {os.cpu_count()} CPUs",
              file=sys.stderr, flush=True)
        rows = {
            "rpc_open": in_client_process("drive", rpc, args.rate, 0, args.duration),
            "http_open": in_client_process("drive", url, args.rate, 0, args.duration),
            "rpc_closed": in_client_process("drive", rpc, None, args.concurrency,
                                            args.closed_duration),
            "http_closed": in_client_process("drive", url, None, args.concurrency,
                                             args.closed_duration),
        }
        streams = {n: (in_client_process("rpc_stream", engine_port, n, args.stream_tokens),
                       in_client_process("stream", url, n, args.stream_tokens))
                   for n in args.streams}
    finally:
        gateway.terminate()
        gateway.wait(30)
        engine.terminate()

    open_mode, closed_mode = "open loop, uniform", f"closed loop, {args.concurrency} in flight"
    print("\n### Short requests (prompt of 7 token ids, max_tokens 1, not streamed)\n")
    print("| path | load | offered req/s | achieved req/s | ok | failed | p50 ms | p99 ms "
          "| max ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    print(request_row("fake engine over RPC (baseline)", open_mode, f"{args.rate:.0f}",
                      rows["rpc_open"]))
    print(request_row("gateway /v1/completions", open_mode, f"{args.rate:.0f}",
                      rows["http_open"]))
    print(request_row("fake engine over RPC (baseline)", closed_mode, "-", rows["rpc_closed"]))
    print(request_row("gateway /v1/completions", closed_mode, "-", rows["http_closed"]))
    added = (statistics.median(rows["http_open"].latencies)
             - statistics.median(rows["rpc_open"].latencies)) * 1e3
    print(f"\nAdded by the gateway at {args.rate:.0f} req/s: {added:.2f} ms at the median.")
    print(f"\n### Streaming (/v1/completions, stream: true, {args.stream_tokens} tokens each, "
          "one token per chunk)\n")
    print("| path | streams | tokens each | chunks | seconds | chunks/s | chunks/s per stream "
          "| gap p50 ms | gap p99 ms | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, (rpc_sample, http_sample) in streams.items():
        print(stream_row("fake engine over RPC (deltas)", n, args.stream_tokens, rpc_sample))
        print(stream_row("gateway SSE", n, args.stream_tokens, http_sample))
    problems = [e for s in [*rows.values(), *(x for pair in streams.values() for x in pair)]
                for e in s.errors]
    if problems:
        print("\nerrors: " + "; ".join(problems), file=sys.stderr)
    if args.json:
        summary = {k: {"ok": s.count, "failed": s.failed, "duration_s": s.duration_s,
                       "p50_ms": _ms(s.latencies, 0.5), "p99_ms": _ms(s.latencies, 0.99)}
                   for k, s in rows.items()}
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
