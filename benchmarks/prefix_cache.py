""".venv/bin/python -m benchmarks.prefix_cache [--system-len 512] [--requests 12] [--rounds 3]

What prefix caching saves: requests sharing a system prompt, and multi-turn chats,
served with and without it, side by side.

The engine in-process on the mid-size random Qwen3-MoE of `benchmarks.generate`, float32,
greedy. Two workloads, new in each round (fresh random tokens: no round finds another's
blocks):
- shared system prompt: one request runs its prefill, then `--requests - 1` more arrive at
  once; each is the same `--system-len` tokens followed by `--user-len` of its own;
- multi-turn: `--chats` conversations of `--turns` turns, each turn's prompt the previous
  one, its answer and `--user-len` new tokens (a turn starts once every answer is in).
Each request asks for `--output-len` tokens. Conditions alternate over `--rounds`; medians.
Caching must not change a token: both engines' outputs are compared every round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.generate import add_workdir_flag, build_checkpoint
from common.messages import GenerateRequest, SamplingParams
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine


@dataclass
class Tally:
    """One workload's run: wall time, each request's time to first token (from when it was
    added), prompt tokens and those the cache held, and every request's output."""

    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)


def run(engine: Engine, tally: Tally, prompts: list[list[int]], output_len: int,
        until_first: bool = False) -> list[list[int]]:
    """Add `prompts` at once and step to the end (`until_first`: until the first of them
    has its first token); their outputs so far, in order."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = [f"r{len(tally.outputs) + i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        assert engine.add(GenerateRequest(rid, prompt, params)) is None
        tally.prompt_tokens += len(prompt)
        tally.outputs[rid] = []
    while engine.has_work() and not (until_first and tally.outputs[ids[0]]):
        for d in engine.step():
            if not tally.outputs[d.request_id]:
                tally.ttft.append(time.perf_counter() - start)
                tally.cached_tokens += d.num_cached_tokens or 0
            tally.outputs[d.request_id] += d.token_ids
    return [tally.outputs[rid] for rid in ids]


def shared_system_prompt(engine: Engine, g: torch.Generator, a: argparse.Namespace) -> Tally:
    system = tokens(g, a.system_len)
    prompts = [system + tokens(g, a.user_len) for _ in range(a.requests)]
    tally = Tally()
    start = time.perf_counter()
    run(engine, tally, prompts[:1], a.output_len, until_first=True)
    run(engine, tally, prompts[1:], a.output_len)
    tally.seconds = time.perf_counter() - start
    return tally


def multi_turn(engine: Engine, g: torch.Generator, a: argparse.Namespace) -> Tally:
    chats = [tokens(g, a.user_len) for _ in range(a.chats)]
    tally = Tally()
    start = time.perf_counter()
    for _ in range(a.turns):
        answers = run(engine, tally, chats, a.output_len)
        chats = [c + out + tokens(g, a.user_len) for c, out in zip(chats, answers, strict=True)]
    tally.seconds = time.perf_counter() - start
    return tally


VOCAB = 32000  # the mid-size model's


def tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


Workload = Callable[[Engine, torch.Generator, argparse.Namespace], Tally]
WORKLOADS: dict[str, Workload] = {"shared system prompt": shared_system_prompt,
                                  "multi-turn": multi_turn}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=32)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--chats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    add_workdir_flag(ap)
    args = ap.parse_args()
    path = build_checkpoint(args.workdir)
    engines = {on: build_engine(AttentionConfig(model=path, max_num_batched_tokens=512,
                                          kv_cache_memory=1 << 30, dtype="float32",
                                          enable_prefix_caching=on))
               for on in (False, True)}
    assert engines[True].model_config.vocab_size == VOCAB
    tallies: dict[tuple[str, bool], list[Tally]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up, and is not reported
        for name, workload in WORKLOADS.items():
            outputs = []
            for on, engine in engines.items():
                tally = workload(engine, torch.Generator().manual_seed(r), args)
                outputs.append(tally.outputs)
                if r:
                    tallies.setdefault((name, on), []).append(tally)
                print(f"round {r}/{args.rounds} {name}, caching {'on' if on else 'off'}: "
                      f"{tally.seconds:.2f} s", flush=True)
            assert outputs[0] == outputs[1], f"{name}: caching changed the outputs"
    print(f"\nmid-size Qwen3-MoE, float32, {args.output_len} output tokens per request, "
          f"median of {args.rounds} rounds\n")
    print("| workload | prefix caching | seconds | mean TTFT s | prompt tokens | cached "
          "| time vs off |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in WORKLOADS:
        off = statistics.median(t.seconds for t in tallies[(name, False)])
        for on in (False, True):
            ts = tallies[(name, on)]
            seconds = statistics.median(t.seconds for t in ts)
            ttft = statistics.median(statistics.mean(t.ttft) for t in ts)
            print(f"| {name} | {'on' if on else 'off'} | {seconds:.2f} | {ttft:.3f} "
                  f"| {ts[0].prompt_tokens:,} | {ts[0].cached_tokens:,} "
                  f"| {seconds / off:.2f}x |")


if __name__ == "__main__":
    main()
