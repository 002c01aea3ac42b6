"""How much of an evaluation the bundled demo model was trained on, and its accuracy on
the rest.

The bundled model was trained before `switchyard.demo_task` held a tenth of the problems
out: its training stream (seed 0, 7,000 steps of 128 problems, then a fine-tune replaying
the first 1,500 steps of the same stream) drew from all 2,000,000 problems, so about a
third of any evaluation's problems were training examples. This replays that stream and
splits an evaluation (`switchyard eval`'s problems, through the whole stack) into the
problems it contains and those it does not.

    .venv/bin/python -m benchmarks.demo_overlap [--num-problems 1000 --seed 2026] \
        [-- SERVE_FLAGS]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

from switchyard.demo_task import draw, problems
from switchyard.eval import evaluate, wilson_interval
from switchyard.serve_process import against_gateway, split_serve_flags


def trained_on(seed: int, steps: int, batch: int) -> set[str]:
    """The questions of the old training stream (every problem eligible)."""
    rng = random.Random(seed)
    return {draw(rng).question for _ in range(steps * batch)}


def row(name: str, correct: list[bool]) -> str:
    n, k = len(correct), sum(correct)
    lo, hi = wilson_interval(k, n)
    return (f"| {name} | {n} | {k}/{n} = {100 * k / max(n, 1):.1f}% "
            f"| {100 * lo:.1f}-{100 * hi:.1f}% |")


def main(argv: list[str]) -> int:
    argv, serve_flags = split_serve_flags(argv)
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running gateway (default: start `switchyard serve`)")
    ap.add_argument("--num-problems", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--train-seed", type=int, default=0)
    ap.add_argument("--train-steps", type=int, default=7000)
    ap.add_argument("--train-batch", type=int, default=128)
    args = ap.parse_args(argv)
    print("replaying the training stream ...", file=sys.stderr, flush=True)
    seen = trained_on(args.train_seed, args.train_steps, args.train_batch)
    probs = problems(args.seed, args.num_problems)
    report = against_gateway(args.url, serve_flags, lambda url: asyncio.run(
        evaluate(url, args.num_problems, args.seed, 32)))
    known = [q.question in seen for q in probs]
    print(f"{sum(known)} of {len(probs)} problems were in the training stream "
          f"({len(seen)} distinct questions of 2,000,000)\n")
    print("| problems | n | exact match | 95% CI |\n|---|---:|---:|---:|")
    print(row("all", report.correct))
    print(row("in the training stream", [c for c, k in zip(report.correct, known,
                                                           strict=True) if k]))
    print(row("never trained on", [c for c, k in zip(report.correct, known,
                                                     strict=True) if not k]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
