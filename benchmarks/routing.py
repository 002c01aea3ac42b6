""".venv/bin/python -m benchmarks.routing [--chats 8] [--turns 4] [--rounds 2]

Prefix-affinity vs least-busy routing over two attention groups: multi-turn chats, each
turn's prompt its chat's history, through `switchyard serve` as real processes.

The mid-size random Qwen3-MoE of `benchmarks.generate`, float32, two attention groups
(`--dispatch-backend local`, one torch thread each), prefix caching on. `--chats` chats of
`--turns` turns run at once, each on its own: a turn's prompt is the previous one, its
answer (greedy, 8 to `--output-len` tokens, drawn per turn) and `--user-len` new tokens,
sent after a pause of up to `--think-s` seconds (uniform, drawn per turn; the chats drift
apart, as users do). Per policy:
wall time, the share of prompt tokens the groups' caches held
(`usage.prompt_tokens_details`), and mean request latency. Policies alternate over
`--rounds`, a new server each time (new random chats per round); medians.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
import torch

from benchmarks.generate import add_workdir_flag, build_checkpoint
from benchmarks.prefix_cache import tokens
from gateway.routing.prefix_affinity import POLICIES
from switchyard.serve_process import Served


async def chats(url: str, args: argparse.Namespace, seed: int) -> tuple[float, float, float]:
    """(seconds, cached share of prompt tokens, mean request seconds) of one workload."""
    g = torch.Generator().manual_seed(seed)
    prompt_tokens = cached = 0
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        name = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def turn(prompt: list[int], output_len: int) -> list[int]:
            nonlocal prompt_tokens, cached
            start = time.perf_counter()
            r = (await http.post("/v1/completions", json={
                "model": name, "prompt": prompt, "max_tokens": output_len,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True})).json()
            latencies.append(time.perf_counter() - start)
            prompt_tokens += r["usage"]["prompt_tokens"]
            cached += (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            return r["choices"][0]["token_ids"]

        async def chat(users: list[list[int]], lengths: list[int], pauses: list[float]
                       ) -> None:
            history: list[int] = []
            for user, n, pause in zip(users, lengths, pauses, strict=True):
                await asyncio.sleep(pause)  # the user thinks (the workload, not a sync)
                history += user
                history += await turn(history, n)

        # drawn up front, so that both policies serve the same chats
        plans = [([tokens(g, args.user_len) for _ in range(args.turns)],
                  torch.randint(8, args.output_len + 1, (args.turns,), generator=g).tolist(),
                  (torch.rand(args.turns, generator=g) * args.think_s).tolist())
                 for _ in range(args.chats)]
        start = time.perf_counter()
        await asyncio.gather(*(chat(*plan) for plan in plans))
        seconds = time.perf_counter() - start
    return seconds, cached / prompt_tokens, statistics.mean(latencies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    add_workdir_flag(ap)
    args = ap.parse_args()
    path = build_checkpoint(args.workdir)
    results: dict[str, list[tuple[float, float, float]]] = {p: [] for p in POLICIES}
    for r in range(args.rounds):
        for policy in POLICIES:
            flags = ["--model", str(path), "--attention-groups", "2", "--dispatch-backend",
                     "local", "--num-threads", "1", "--dtype", "float32",
                     "--kv-cache-memory", "1GiB", "--enable-prompt-tokens-details",
                     "--routing-policy", policy]
            with Served(flags) as served:
                results[policy].append(asyncio.run(chats(served.url, args, r)))
            seconds, share, latency = results[policy][-1]
            print(f"round {r + 1}/{args.rounds} {policy}: {seconds:.2f} s, cached "
                  f"{share:.0%}, mean latency {latency:.2f} s", flush=True)
    print(f"\n{args.chats} chats x {args.turns} turns, up to {args.think_s:g} s between "
          f"turns, 2 attention groups, median of {args.rounds}\n")
    print("| routing | seconds | prompt tokens cached | mean request s | time vs least-busy |")
    print("|---|---:|---:|---:|---:|")
    base = statistics.median(s for s, _, _ in results["least-busy"])
    for policy, runs in results.items():
        seconds = statistics.median(s for s, _, _ in runs)
        print(f"| {policy} | {seconds:.2f} | {statistics.median(c for _, c, _ in runs):.0%} "
              f"| {statistics.median(m for _, _, m in runs):.2f} | {seconds / base:.2f}x |")


if __name__ == "__main__":
    main()
