"""`switchyard eval`: exact-match accuracy of the demo task through the gateway's chat API.

Draws held-out problems from a seed (`switchyard.demo_task`), asks each as a chat user
message with greedy decoding, and reports exact match with a 95% Wilson interval, overall,
by the operands' digit counts and by operation, plus how the router spread the
evaluation's tokens over the experts. That comes from the gateway's `/stats`, an operator
endpoint, so `--api-key` must then be an admin key where the gateway has one.
Without `--url` it starts `switchyard serve --port 0 SERVE_FLAGS...` itself, so any
topology can be evaluated: `switchyard eval -- --max-num-seqs 8`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

import httpx

from switchyard.demo_task import Problem, is_correct, problems
from switchyard.serve_process import against_gateway, split_serve_flags


@dataclass(frozen=True)
class EvalReport:
    num_problems: int
    num_correct: int
    accuracy: float
    ci95: tuple[float, float]
    expert_load: list[list[int]]  # routed token copies per [layer][expert] during the eval
    max_load_over_fair: float  # over MoE layers: the busiest expert's load / fair share
    min_load_over_fair: float
    failures: list[tuple[str, str, str]]  # (question, expected, got), at most 20
    correct: list[bool]  # per problem, in the order `problems(seed, n)` draws them
    slices: dict[str, tuple[int, int]]  # "1x3", "+", ...: (correct, asked)

    def slice_accuracy(self, name: str) -> float:
        right, asked = self.slices[name]
        return right / asked


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, center - half), min(1.0, center + half))


async def ask(client: httpx.AsyncClient, model: str, p: Problem, sem: asyncio.Semaphore) -> str:
    """One problem as a chat user message, greedy: the reply's text."""
    async with sem:
        r = await client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": p.question}],
            "max_tokens": 8, "temperature": 0})
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"] or ""


def by_slice(probs: list[Problem], correct: list[bool]) -> dict[str, tuple[int, int]]:
    """(correct, asked) by the operands' digit counts ("1x1" .. "3x3"), then by operation."""
    out: dict[str, tuple[int, int]] = {}
    for key in [*sorted({p.slice for p in probs}), "+", "-"]:
        mine = [ok for p, ok in zip(probs, correct, strict=True) if key in (p.slice, p.op)]
        if mine:
            out[key] = (sum(mine), len(mine))
    return out


async def evaluate(url: str, num_problems: int, seed: int, concurrency: int,
                   api_key: str | None = None) -> EvalReport:
    probs = problems(seed, num_problems)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before = (await client.get("/stats")).json()["expert_load"]
        sem = asyncio.Semaphore(concurrency)
        replies = await asyncio.gather(*(ask(client, model, p, sem) for p in probs))
        after = (await client.get("/stats")).json()["expert_load"]
    load = [[a - b for a, b in zip(ra, rb, strict=True)] for ra, rb in zip(after, before,
                                                                            strict=True)]
    correct = [is_correct(p, r) for p, r in zip(probs, replies, strict=True)]
    ratios = [e * len(row) / sum(row) for row in load if sum(row) for e in row]
    return EvalReport(
        num_problems=num_problems, num_correct=sum(correct),
        accuracy=sum(correct) / num_problems, ci95=wilson_interval(sum(correct), num_problems),
        expert_load=load, max_load_over_fair=max(ratios, default=0.0),
        min_load_over_fair=min(ratios, default=0.0),
        failures=[(p.question, p.answer, r) for p, r, ok in zip(probs, replies, correct,
                                                                strict=True) if not ok][:20],
        correct=correct,
        slices=by_slice(probs, correct),
    )


def format_report(r: EvalReport) -> str:
    lines = [f"exact match: {r.num_correct}/{r.num_problems} = {100 * r.accuracy:.1f}% "
             f"(95% CI {100 * r.ci95[0]:.1f}-{100 * r.ci95[1]:.1f}%)",
             "per-expert routing load (token copies per layer):"]
    lines += [f"  layer {i}: {' '.join(f'{n:5d}' for n in row)}"
              for i, row in enumerate(r.expert_load) if sum(row)]
    lines.append(f"busiest expert / fair share: {r.max_load_over_fair:.2f}; "
                 f"idlest: {r.min_load_over_fair:.2f}")
    lines.append("by slice (operands' digit counts, then operation):")
    lines += [f"  {name:>3}: {right:4d}/{asked:4d} = {100 * right / asked:5.1f}%"
              for name, (right, asked) in r.slices.items()]
    lines += [f"  wrong: {q} expected {a!r} got {g!r}" for q, a, g in r.failures[:5]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    argv, serve_flags = split_serve_flags(argv)
    ap = argparse.ArgumentParser(prog="switchyard eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running gateway (default: start `switchyard serve`)")
    ap.add_argument("--num-problems", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--json", help="also write the report as JSON to this file")
    ap.add_argument("--api-key", default=os.environ.get("SWITCHYARD_API_KEY", "").split(",")[0]
                    or None, help="sent as a bearer token (default: the first of "
                                  "SWITCHYARD_API_KEY); /stats needs the admin key if any")
    args = ap.parse_args(argv)
    if args.url and serve_flags:
        ap.error("the flags after -- start a server; with --url there is none to start")
    report = against_gateway(args.url, serve_flags, lambda url: asyncio.run(
        evaluate(url, args.num_problems, args.seed, args.concurrency, args.api_key)))
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
