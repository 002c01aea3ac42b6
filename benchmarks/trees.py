"""Two source trees of Switchyard served side by side: TPOT and output tokens/s through
HTTP in the same topology, the trees alternated round by round (this machine is noisy).

    .venv/bin/python -m benchmarks.trees --tree before=/tmp/old --tree after=. \\
        [--concurrency 1 16] [--rounds 2] [--input-len 128] [--output-len 128] \\
        [-- SERVE_FLAGS]

Each tree's `switchyard serve` (default: the default topology, an attention service and
two rpc expert services) runs from that tree (its processes import that tree's code) on
the mid-size random checkpoint of benchmarks/generate.py, in float32, loaded by
`switchyard bench`'s client with the same fixed-seed prompts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import httpx

from benchmarks.generate import add_workdir_flag, build_checkpoint
from switchyard.bench import make_prompts, run_load, summarize
from switchyard.serve_process import Served, split_serve_flags


def measure(tree: Path, model_dir: Path, flags: list[str], prompts: list[list[int]],
            levels: list[int], output_len: int) -> dict[int, dict]:
    """One round of `tree`'s serve: per concurrency, `summarize`'s report."""
    here = Path.cwd()
    os.chdir(tree)  # `python -m switchyard` and its children import from the cwd first
    try:
        with Served(["--model", str(model_dir), "--kv-cache-memory", "1GiB", *flags],
                    env={"PYTHONPATH": str(tree)}, timeout=900) as served:
            name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
            run_load(served.url, name, prompts[:2], 4, 2, None, 1, 0)  # warm caches
            out = {}
            for c in levels:
                records, duration = run_load(served.url, name, prompts[:max(c, 4)],
                                             output_len, c, None, min(4, c), 0)
                out[c] = summarize(records, duration, c, min(4, c))
            return out
    finally:
        os.chdir(here)


def main() -> None:
    own, serve_flags = split_serve_flags(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workdir_flag(ap)
    ap.add_argument("--tree", action="append", required=True, help="NAME=DIR, twice or more")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args(own)
    trees = [(name, Path(d).resolve()) for name, d in (t.split("=", 1) for t in args.tree)]
    model_dir = build_checkpoint(args.workdir)
    prompts = make_prompts(max(max(args.concurrency), 4), args.input_len, 0.0, 200, seed=0)
    results: dict[str, list[dict[int, dict]]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        for name, tree in trees if r % 2 == 0 else trees[::-1]:
            print(f"round {r + 1}/{args.rounds}: {name} ({tree}) ...", flush=True)
            results[name].append(measure(tree, model_dir, serve_flags, prompts,
                                         args.concurrency, args.output_len))
    first = trees[0][0]
    print(f"\n| tree | concurrency | median TPOT (ms), per round | output tok/s, per round "
          f"| TPOT vs {first} |")
    print("|---|---:|---|---|---:|")
    base = {c: statistics.median(rnd[c]["tpot"]["median_ms"] for rnd in results[first])
            for c in args.concurrency}
    for name, _ in trees:
        for c in args.concurrency:
            tpots = [rnd[c]["tpot"]["median_ms"] for rnd in results[name]]
            rates = [rnd[c]["output_throughput"] for rnd in results[name]]
            ratio = statistics.median(tpots) / base[c]
            print(f"| {name} | {c} | {', '.join(f'{t:.1f}' for t in tpots)} | "
                  f"{', '.join(f'{x:.1f}' for x in rates)} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
