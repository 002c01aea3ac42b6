""".venv/bin/python -m benchmarks.spec_serving [--k 1 2] [--concurrency 1 16 64]
                                            [--requests 64] [--rounds 2] [FLAGS ...]

What MTP speculation gives served, on the bundled model with its own questions.

For each configuration (off, then MTP with each `--k`), `switchyard serve` of the bundled
model (its default topology, or FLAGS after `--`) answers held-out arithmetic questions
through the chat API, greedy, each answer as long as the model makes it (no
`ignore_eos`). At each concurrency, `--requests` questions (at least 4x the
concurrency); the configurations run in turn for `--rounds` rounds (this machine is
noisy), medians reported, and each "vs off" the median over rounds of the ratio to that
round's off:

- output tokens/s over the level, and the median and p90 request latency;
- the acceptance rate (accepted / drafted tokens) and the mean accepted length
  (1 + accepted / drafts: tokens a verify step emits), from the gateway's /metrics
  (vLLM's `spec_decode` counters);
- whether every answer is the one without speculation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serving import log
from switchyard.bench import percentile
from switchyard.demo_task import problems
from switchyard.serve_process import Served

COUNTERS = ("switchyard:spec_decode_num_drafts", "switchyard:spec_decode_num_draft_tokens",
            "switchyard:spec_decode_num_accepted_tokens")


def counters(url: str) -> dict[str, float]:
    """The gateway's merged speculation counters (totals over its attention services)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in out and sample.name.endswith("_total"):
                out[name] += sample.value
    return out


async def _answers(url: str, model: str, questions: list[str], concurrency: int
                   ) -> tuple[list[str], list[float], int, float]:
    """Each question's answer and latency, the completion tokens, the level's seconds."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(question: str) -> tuple[str, float, int]:
            async with gate:
                start = time.perf_counter()
                r = await client.post("/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": question}],
                    "temperature": 0, "max_tokens": 16})
                r.raise_for_status()
                body = r.json()
                return (body["choices"][0]["message"]["content"], time.perf_counter() - start,
                        body["usage"]["completion_tokens"])

        start = time.perf_counter()
        done = await asyncio.gather(*(one(q) for q in questions))
        seconds = time.perf_counter() - start
    return [d[0] for d in done], [d[1] for d in done], sum(d[2] for d in done), seconds


def level(url: str, model: str, questions: list[str], concurrency: int) -> dict:
    before = counters(url)
    answers, latencies, tokens, seconds = asyncio.run(
        _answers(url, model, questions, concurrency))
    after = counters(url)
    drafts, drafted, accepted = (after[c] - before[c] for c in COUNTERS)
    return {"answers": answers, "tokens_per_s": tokens / seconds,
            "latency_ms": 1e3 * statistics.median(latencies),
            "p90_ms": 1e3 * percentile(latencies, 90),
            "acceptance": accepted / drafted if drafted else None,
            "accepted_length": 1 + accepted / drafts if drafts else None}


def run(flags: list[str], levels: list[int], requests: int) -> dict[int, dict]:
    with Served(flags, timeout=300) as served:
        model = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        warm = [p.question for p in problems(99, 8)]
        level(served.url, model, warm, 4)
        return {c: level(served.url, model, [p.question for p in problems(
            7, max(requests, 4 * c))], c) for c in levels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--disable-by-batch-size", type=int, default=None, metavar="N",
                    help="speculation's threshold (default: the method's; 0: none)")
    ap.add_argument("--json", default=None, help="write every round's figures here")
    ap.add_argument("flags", nargs="*", help="serve's flags (after --)")
    args = ap.parse_args()
    limit = {} if args.disable_by_batch_size is None else {
        "disable_by_batch_size": args.disable_by_batch_size or None}
    configs = {"off": [], **{f"MTP k={k}": ["--speculative-config", json.dumps(
        {"method": "mtp", "num_speculative_tokens": k, **limit})] for k in args.k}}
    rounds: dict[str, list[dict[int, dict]]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, spec in configs.items():
            log(f"round {r + 1}/{args.rounds}: {name} ...")
            rounds[name].append(run([*args.flags, *spec], args.concurrency, args.requests))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)
    print("| concurrency | configuration | output tokens/s | vs off | latency p50 (ms) | "
          "vs off | p90 (ms) | acceptance | mean accepted length | answers as off |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in args.concurrency:
        for name, runs in rounds.items():
            med = {key: statistics.median(r[c][key] for r in runs)
                   for key in ("tokens_per_s", "latency_ms", "p90_ms")}
            ratio = {key: statistics.median(r[c][key] / off[c][key] for r, off in zip(
                runs, rounds["off"], strict=True)) for key in ("tokens_per_s", "latency_ms")}
            acc = [r[c]["acceptance"] for r in runs if r[c]["acceptance"] is not None]
            length = [r[c]["accepted_length"] for r in runs
                      if r[c]["accepted_length"] is not None]
            same = all(r[c]["answers"] == rounds["off"][0][c]["answers"] for r in runs)
            print(f"| {c} | {name} | {med['tokens_per_s']:.0f} | "
                  f"{ratio['tokens_per_s']:.2f}x | "
                  f"{med['latency_ms']:.1f} | {ratio['latency_ms']:.2f}x | "
                  f"{med['p90_ms']:.1f} | "
                  f"{f'{statistics.median(acc):.0%}' if acc else '-'} | "
                  f"{f'{statistics.median(length):.2f}' if length else '-'} | "
                  f"{'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
