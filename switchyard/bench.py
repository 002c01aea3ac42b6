"""`switchyard bench`: an OpenAI-API load generator, reporting like `vllm bench serve`.

Fixed-seed synthetic token-id prompts of `--input-len` tokens (the first
`--shared-prefix-fraction` of them shared by every prompt) ask for exactly `--output-len`
tokens each through streaming `/v1/completions`. For each concurrency of the sweep (or at
a Poisson `--request-rate`), it reports completed and failed requests, request and token
throughput, and mean / median / p99 of TTFT, TPOT, ITL and end-to-end latency, as a table
and as JSON. The client runs in `--client-processes` processes, so that one Python event
loop does not inflate the latencies it measures. Without `--url` it starts
`switchyard serve --port 0 SERVE_FLAGS...` itself: `switchyard bench -- --expert-services 4`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

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


async def _one(client: httpx.AsyncClient, load: Load, prompt: list[int]) -> RequestRecord:
    record = RequestRecord(ok=False, prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json={
                "model": load.model, "prompt": prompt, "max_tokens": load.output_len,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "return_token_ids": True}) as r:
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                tokens = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
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
        record.ok = record.output_tokens == load.output_len
        if not record.ok:
            record.error = f"got {record.output_tokens} of {load.output_len} tokens"
    except (httpx.HTTPError, ValueError) as exc:
        record.error = repr(exc)
    return record


async def _run(load: Load) -> list[RequestRecord]:
    sem = asyncio.Semaphore(load.concurrency)
    rng = random.Random(load.seed)
    limits = httpx.Limits(max_connections=load.concurrency + 4)
    async with httpx.AsyncClient(base_url=load.url, timeout=3600, limits=limits) as client:
        async def gated(prompt: list[int]) -> RequestRecord:
            async with sem:
                return await _one(client, load, prompt)

        tasks = []
        for prompt in load.prompts:
            tasks.append(asyncio.create_task(gated(prompt)))
            if load.request_rate:
                await asyncio.sleep(rng.expovariate(load.request_rate))  # Poisson arrivals
        return list(await asyncio.gather(*tasks))


def _client_process(load: Load, out: mp.Queue) -> None:
    out.put([asdict(r) for r in asyncio.run(_run(load))])


def run_load(url: str, model: str, prompts: list[list[int]], output_len: int,
             concurrency: int, request_rate: float | None, processes: int, seed: int
             ) -> tuple[list[RequestRecord], float]:
    """Split prompts and concurrency over client processes; return records and duration."""
    processes = max(1, min(processes, concurrency, len(prompts)))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    for i in range(processes):
        share = concurrency // processes + (i < concurrency % processes)
        rate = request_rate / processes if request_rate else None
        load = Load(url, model, prompts[i::processes], output_len, share, rate, seed + i)
        procs.append(ctx.Process(target=_client_process, args=(load, queue), daemon=True))
    start = time.perf_counter()
    for p in procs:
        p.start()
    records = [RequestRecord(**r) for _ in procs for r in queue.get(timeout=7200)]
    duration = time.perf_counter() - start
    for p in procs:
        p.join()
    return records, duration


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"mean_ms": 1e3 * statistics.fmean(values),
            "median_ms": 1e3 * statistics.median(values), "p99_ms": 1e3 * p99}


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
    return "\n".join(lines)


def bench(url: str, args: argparse.Namespace) -> list[dict]:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
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
    reports = against_gateway(args.url, serve_flags, lambda url: bench(url, args))
    print(format_table(reports))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in reports) else 1
