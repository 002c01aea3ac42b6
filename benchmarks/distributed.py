""".venv/bin/python -m benchmarks.distributed [--model DIR] [--concurrency 16]

End-to-end output tokens/s of distributed topologies vs. the single-process engine.

Each topology is started with `switchyard serve`, then `--concurrency` requests of
`--input-len` random token ids each ask for exactly `--output-len` tokens (greedy,
ignore_eos) through /v1/completions, once to warm up and once measured. Default model:
the mid-size random checkpoint of benchmarks/generate.py (built there if missing).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import httpx
import torch

from benchmarks.generate import add_workdir_flag, build_checkpoint
from switchyard.serve_process import Served

TOPOLOGIES = [
    ("single process (local)", ["--dispatch-backend", "local"]),
    ("rpc, 1 expert service", ["--dispatch-backend", "rpc", "--expert-services", "1"]),
    ("rpc, 2 expert services", ["--dispatch-backend", "rpc", "--expert-services", "2"]),
    ("rpc, 4 expert services", ["--dispatch-backend", "rpc", "--expert-services", "4"]),
    ("torch, 1 expert service", ["--dispatch-backend", "torch", "--expert-services", "1"]),
    ("torch, 2 expert services", ["--dispatch-backend", "torch", "--expert-services", "2"]),
    ("torch, 4 expert services", ["--dispatch-backend", "torch", "--expert-services", "4"]),
]


async def _round(url: str, prompts: list[list[int]], output_len: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=1200) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(p: list[int]) -> int:
            r = await client.post("/v1/completions", json={
                "model": model, "prompt": p, "max_tokens": output_len, "temperature": 0,
                "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        produced = sum(await asyncio.gather(*(one(p) for p in prompts)))
        return produced / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--only", nargs="*", help="substrings of topology names to run")
    add_workdir_flag(ap)
    args = ap.parse_args()
    if args.model is None:
        args.model = build_checkpoint(args.workdir)
    g = torch.Generator().manual_seed(0)
    # Ids below 200 are valid for every checkpoint we bench (the tiny test ones included).
    prompts = torch.randint(0, 200, (args.concurrency, args.input_len), generator=g).tolist()
    rows = []
    for name, flags in TOPOLOGIES:
        if args.only and not any(o in name for o in args.only):
            continue
        print(f"{name}: starting ...", flush=True)
        with Served(["--model", str(args.model), "--kv-cache-memory", "512MiB", *flags],
                    timeout=600) as served:
            asyncio.run(_round(served.url, prompts[:2], 4))  # warm-up
            tps = asyncio.run(_round(served.url, prompts, args.output_len))
        print(f"{name}: {tps:.1f} output tok/s", flush=True)
        rows.append((name, tps))
    base = rows[0][1]
    print(f"\nconcurrency {args.concurrency}, {args.input_len} input + {args.output_len} "
          f"output tokens, float32, through HTTP")
    print("| topology | output tok/s | vs. first row |")
    print("|---|---:|---:|")
    for name, tps in rows:
        print(f"| {name} | {tps:.1f} | {tps / base:.2f}x |")


if __name__ == "__main__":
    main()
