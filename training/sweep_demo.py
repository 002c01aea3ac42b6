"""Ask a served demo model whole families of problems a person might try, beyond the
held-out draw: subtractions of close numbers, whose answers are much shorter than their
operands (the family the fine-tune in docs/benchmarks.md fixed).

    .venv/bin/python training/sweep_demo.py [--model DIR] [-- SERVE FLAGS]

Starts `switchyard serve` (float32, the default topology) and prints, per family, how
many answers were exactly right and the first wrong ones.
"""

from __future__ import annotations

import argparse
import asyncio
import random

import httpx

from switchyard.demo_model import DEFAULT_MODEL
from switchyard.demo_task import Problem, draw, is_correct
from switchyard.eval import ask
from switchyard.serve_process import Served, split_serve_flags


def families() -> dict[str, list[Problem]]:
    rng = random.Random(99)
    close = [Problem(a, "-", b) for a in range(10, 1000)
             for b in range(max(10, a - 20), min(999, a + 20) + 1)]
    return {
        "a - b, a and b in 900..999": [Problem(a, "-", b) for a in range(900, 1000)
                                       for b in range(900, 1000)],
        "a - b, a and b in 100..199": [Problem(a, "-", b) for a in range(100, 200)
                                       for b in range(100, 200)],
        "a - b, |a - b| <= 20, 10 <= a, b <= 999 (every third)": close[::3],
        "demo_task.draw (seed 99)": [draw(rng) for _ in range(10_000)],
    }


async def ask_all(url: str, probs: list[Problem], concurrency: int = 32) -> list[str]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        return await asyncio.gather(*(ask(client, model, p, sem) for p in probs))


def main() -> None:
    import sys

    argv, serve_flags = split_serve_flags(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    args = ap.parse_args(argv)
    with Served(["--model", args.model, *serve_flags]) as served:
        for name, probs in families().items():
            replies = asyncio.run(ask_all(served.url, probs))
            wrong = [(p.question, r) for p, r in zip(probs, replies, strict=True)
                     if not is_correct(p, r)]
            print(f"{name}: {len(probs) - len(wrong)}/{len(probs)} right; wrong: "
                  f"{wrong[:5]}", flush=True)


if __name__ == "__main__":
    main()
