"""`switchyard bench`: an OpenAI-API load generator, reporting like `vllm bench serve`.

Fixed-seed synthetic token-id prompts of `--input-len` tokens each ask for exactly
`--output-len` tokens through streaming `/v1/completions`; the first
`--shared-prefix-fraction` of the tokens is shared by every prompt. For each concurrency of
the sweep, or at a Poisson `--request-rate`, it reports completed and failed requests,
request and token throughput, and mean / median / p99 of TTFT, TPOT, ITL and end-to-end
latency, as a table and as JSON. It counts each failure by its cause: the status and the
body's start, the tokens asked and got, or the client's exception. A request whose
kept-alive connection the server closed before answering is sent again, and counted as
such. The client runs in `--client-processes` processes, so that one Python event loop does
not inflate the latencies it measures. Without `--url` it starts
`switchyard serve --port 0 SERVE_FLAGS...` itself: `switchyard bench -- --expert-services 4`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from switchyard.serve_process import against_gateway, split_serve_flags


@dataclass
class RequestRecord:
    """One request as the client saw it (seconds since its own start)."""

    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    retried: bool = False  # sent again: its kept-alive connection closed before an answer


@dataclass(frozen=True)
class Load:
    url: str
    model: str
    prompts: list[list[int]]
    output_len: int
    concurrency: int
    request_rate: float | None  # requests/s (Poisson arrivals), or None: as fast as allowed
    seed: int


def make_prompts(n: int, input_len: int, shared_fraction: float, id_range: int, seed: int
                 ) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(id_range) for _ in range(int(input_len * shared_fraction))]
    return [shared + [rng.randrange(id_range) for _ in range(input_len - len(shared))]
            for _ in range(n)]


def _chunk_tokens(choice: dict[str, Any]) -> int:
    """Output tokens in a streamed choice: its `token_ids`, as Switchyard and vLLM with
    `return_token_ids` send them, else one for non-empty text, as `vllm bench serve`
    counts."""
    return len(choice.get("token_ids") or []) or int(bool(choice.get("text")))


async def _one(client: httpx.AsyncClient, load: Load, prompt: list[int]) -> RequestRecord:
    """One streamed request (`_attempt`), sent once more where the server closed a
    kept-alive connection as the request went out, before any answer.

    A server that closes idle or used connections, as llama.cpp's cpp-httplib does, races
    the client's next request on them, and that request never reached the server's
    handler. curl and urllib3 retry the same way. It is counted as retried, not failed.
    """
    record = await _attempt(client, load, prompt)
    if record.error.startswith(DROPPED):
        record = await _attempt(client, load, prompt)
        record.retried = True
    return record


DROPPED = "dropped before an answer"  # the cause `_attempt` gives that case


async def _attempt(client: httpx.AsyncClient, load: Load, prompt: list[int]
                   ) -> RequestRecord:
    """One streamed request. Content chunks time TTFT and ITL; the final usage chunk
    (`stream_options.include_usage`), where the server sends one, gives the token count.
    A failure says why: the status and the body's start, the token count asked and
    got, or the client's exception."""
    record = RequestRecord(ok=False, prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    usage_tokens: int | None = None
    answered = False
    try:
        async with client.stream("POST", "/v1/completions", json={
                "model": load.model, "prompt": prompt, "max_tokens": load.output_len,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}) as r:
            answered = True
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if usage := chunk.get("usage"):
                    usage_tokens = usage["completion_tokens"]
                tokens = sum(_chunk_tokens(c) for c in chunk.get("choices") or [])
                if not tokens:
                    continue
                now = time.perf_counter()
                if record.output_tokens == 0:
                    record.ttft = now - start
                else:
                    record.itls.append(now - last)
                last = now
                record.output_tokens += tokens
        record.e2e = time.perf_counter() - start
        if usage_tokens is not None:
            record.output_tokens = usage_tokens
        record.ok = record.output_tokens == load.output_len
        if not record.ok:
            record.error = f"got {record.output_tokens} of {load.output_len} tokens"
    except httpx.RemoteProtocolError as exc:
        record.error = f"{DROPPED}: {exc}" if not answered else repr(exc)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:  # or a malformed chunk
        record.error = repr(exc)
    return record


async def _run(load: Load, start: Callable[[], None] = lambda: None) -> list[RequestRecord]:
    """The load's requests; `start` is called once the client is built (it may block)."""
    sem = asyncio.Semaphore(load.concurrency)
    rng = random.Random(load.seed)
    limits = httpx.Limits(max_connections=load.concurrency + 4)
    async with httpx.AsyncClient(base_url=load.url, timeout=3600, limits=limits) as client:
        start()

        async def gated(prompt: list[int]) -> RequestRecord:
            async with sem:
                return await _one(client, load, prompt)

        tasks = []
        for prompt in load.prompts:
            tasks.append(asyncio.create_task(gated(prompt)))
            if load.request_rate:
                await asyncio.sleep(rng.expovariate(load.request_rate))  # Poisson arrivals
        return list(await asyncio.gather(*tasks))


def _client_process(load: Load, ready: mp.Queue, go: mp.Event, out: mp.Queue) -> None:
    started = []

    def start() -> None:  # imported, client built: what follows is the load itself
        ready.put(None)
        go.wait()
        started.append(time.monotonic())  # system-wide on Linux: comparable across processes

    records = asyncio.run(_run(load, start))
    out.put((started[0], time.monotonic(), [asdict(r) for r in records]))


def split_load(prompts: list[list[int]], concurrency: int, request_rate: float | None,
               processes: int) -> list[tuple[list[list[int]], int, float | None]]:
    """(prompts, concurrency, rate) per client process. Prompts and rate are in proportion
    to the process's share of the concurrency, so every process keeps its share busy until
    the end. An even split of prompts over uneven shares let the run end half-loaded."""
    processes = max(1, min(processes, concurrency, len(prompts)))
    shares = [concurrency // processes + (i < concurrency % processes)
              for i in range(processes)]
    slots = [i for i, share in enumerate(shares) for _ in range(share)]  # one per request slot
    return [([p for j, p in enumerate(prompts) if slots[j % concurrency] == i], share,
             request_rate * share / concurrency if request_rate else None)
            for i, share in enumerate(shares)]


def run_load(url: str, model: str, prompts: list[list[int]], output_len: int,
             concurrency: int, request_rate: float | None, processes: int, seed: int
             ) -> tuple[list[RequestRecord], float]:
    """Split prompts and concurrency over client processes; return records and duration.
    The clock runs from when every process, started and ready, is let go, to the last
    one's end: starting Python processes is not the server's time."""
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_client_process, daemon=True, args=(
        Load(url, model, share_prompts, output_len, share, rate, seed + i), ready, go, out))
        for i, (share_prompts, share, rate) in enumerate(
            split_load(prompts, concurrency, request_rate, processes))]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            _get(ready, procs, 300)
        go.set()
        results = [_get(out, procs, 7200) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    duration = max(end for _, end, _ in results) - min(start for start, _, _ in results)
    return [RequestRecord(**r) for _, _, records in results for r in records], duration


def _get(q: mp.Queue, procs: list, timeout: float) -> Any:
    """The next item of `q`. Raises a RuntimeError if a client process died or time ran
    out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=1)
        except queue.Empty:
            if dead := [p.exitcode for p in procs if p.exitcode not in (None, 0)]:
                raise RuntimeError(f"a client process exited with status {dead[0]}") from None
    raise RuntimeError(f"the client processes gave no answer within {timeout:.0f} s")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between closest ranks, as numpy's default, which
    `vllm bench serve` reports. It is not the max for q = 99 of 100 values."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    return {"mean_ms": 1e3 * statistics.fmean(values),
            "median_ms": 1e3 * statistics.median(values),
            "p99_ms": 1e3 * percentile(values, 99)}


def summarize(records: list[RequestRecord], duration: float, concurrency: int,
              processes: int) -> dict[str, object]:
    """The report for one load level (the fields `vllm bench serve` prints)."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "concurrency": concurrency, "client_processes": processes,
        "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        # each cause of failure, how often (as GuideLLM and `vllm bench` count them)
        "failures": dict(Counter(r.error for r in records if not r.ok).most_common()),
        "retried": sum(r.retried for r in records),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft": _stats([r.ttft for r in ok]), "tpot": _stats(tpot),
        "itl": _stats([x for r in ok for x in r.itls]), "e2e": _stats([r.e2e for r in ok]),
    }


def format_table(reports: list[dict]) -> str:
    head = ("| conc. | procs | ok | failed | req/s | out tok/s | total tok/s | "
            "TTFT mean/med/p99 ms | TPOT mean/med/p99 ms | ITL mean/med/p99 ms | "
            "E2E mean/med/p99 ms |")
    lines = [head, "|" + "---:|" * 11]
    for r in reports:
        cells = [f"{r[k]['mean_ms']:.0f}/{r[k]['median_ms']:.0f}/{r[k]['p99_ms']:.0f}"
                 for k in ("ttft", "tpot", "itl", "e2e")]
        lines.append(f"| {r['concurrency']} | {r['client_processes']} | {r['completed']} | "
                     f"{r['failed']} | {r['request_throughput']:.2f} | "
                     f"{r['output_throughput']:.1f} | {r['total_token_throughput']:.1f} | "
                     + " | ".join(cells) + " |")
    for r in reports:
        causes = [f"{n} x {cause}" for cause, n in r["failures"].items()]
        if r["retried"]:
            causes.append(f"{r['retried']} sent again after the server closed their "
                          "kept-alive connection (not failed)")
        if causes:
            lines.append(f"\nconcurrency {r['concurrency']}: " + "; ".join(causes))
    return "\n".join(lines)


def warm_up(url: str, model: str, prompt: list[int], output_len: int) -> None:
    """One untimed request, as `vllm bench serve`'s initial test run. First-call costs,
    such as kernel compilation and allocator growth, stay out of the first level, and a
    server that cannot answer stops the run here."""
    async def once() -> RequestRecord:
        async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
            return await _one(client, Load(url, model, [prompt], output_len, 1, None, 0),
                              prompt)

    record = asyncio.run(once())
    if not record.ok:
        raise RuntimeError(f"the warm-up request failed: {record.error}")


def bench(url: str, args: argparse.Namespace) -> list[dict]:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    warm_up(url, model, make_prompts(1, args.input_len, 0.0, args.token_id_range,
                                     args.seed + 1)[0], args.output_len)
    reports = []
    for concurrency in args.concurrency:
        n = args.num_prompts or max(4 * concurrency, 8)
        prompts = make_prompts(n, args.input_len, args.shared_prefix_fraction,
                               args.token_id_range, args.seed)
        print(f"concurrency {concurrency}: {n} requests ...", file=sys.stderr, flush=True)
        records, duration = run_load(url, model, prompts, args.output_len, concurrency,
                                     args.request_rate, args.client_processes, args.seed)
        reports.append(summarize(records, duration, concurrency,
                                 max(1, min(args.client_processes, concurrency, n))))
    return reports


def main(argv: list[str]) -> int:
    argv, serve_flags = split_serve_flags(argv)
    ap = argparse.ArgumentParser(prog="switchyard bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running gateway (default: start `switchyard serve`)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--request-rate", type=float, default=None,
                    help="requests/s with Poisson arrivals (still capped by --concurrency)")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="requests per level (default: 4x the concurrency, at least 8)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--shared-prefix-fraction", type=float, default=0.0)
    ap.add_argument("--token-id-range", type=int, default=200,
                    help="prompt token ids are drawn from [0, N): keep N within the vocab")
    ap.add_argument("--client-processes", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the reports as JSON to this file")
    args = ap.parse_args(argv)
    if not 0.0 <= args.shared_prefix_fraction <= 1.0:
        ap.error("--shared-prefix-fraction must be within [0, 1]")
    if args.url and serve_flags:
        ap.error("the flags after -- start a server; with --url there is none to start")
    try:
        reports = against_gateway(args.url, serve_flags, lambda url: bench(url, args))
    except RuntimeError as exc:
        print(f"switchyard bench: {exc}", file=sys.stderr)
        return 1
    print(format_table(reports))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in reports) else 1
