""".venv/bin/python -m benchmarks.timeline [--delay-ms 5] [--micro-batches 2]
                                        [--concurrency 16] [--layers 3]

One decode step's timeline with the experts behind a wire delay: when each
micro-batch computes on the attention side and when its layer calls are out
(`Engine.last_timeline`, the intervals the step's span draws).

An attention engine in this process (the mid-size checkpoint, `rpc`) calls two expert
services through delaying proxies (`benchmarks.wire`); 16 sequences decode a few steps,
then `--steps` are timed and the last one's timeline printed: per micro-batch and MoE
layer, when it computed up to that layer's call and when the call's answers were back,
and how long the slowest expert rank held that call (its queue and compute; the rest is
the wire), in milliseconds. A pipeline that hides the wire shows one micro-batch's
compute inside the other's exchange. (It runs itself again with OMP_WAIT_POLICY=PASSIVE,
as `serve` runs its services.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.generate import add_workdir_flag, build_checkpoint
from benchmarks.wire import delayed_experts
from common.rpc import parse_address
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from tests.support.engines import greedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workdir_flag(ap)
    ap.add_argument("--delay-ms", type=float, default=5.0)
    ap.add_argument("--micro-batches", default="2")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4, help="MoE layers to print")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed (mean)")
    args = ap.parse_args()
    if os.environ.get("OMP_WAIT_POLICY") != "PASSIVE":  # as `serve` runs its services:
        # OpenMP's spin-waiting here would take the cores the expert services need
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.timeline",
                                   *sys.argv[1:]], {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    path = build_checkpoint(args.workdir)
    with delayed_experts(path, args.micro_batches, args.delay_ms) as delayed:
        [(_, attention)] = delayed.services.attention
        addresses = [parse_address(a) for a in
                     attention[attention.index("--expert-addresses") + 1].split(",")]
        engine = build_engine(AttentionConfig(
            model=path, dispatch_backend="rpc", expert_addresses=tuple(addresses),
            secret=delayed.secret, kv_cache_memory=1 << 30,
            micro_batches=args.micro_batches, max_num_batched_tokens=4096))
        for i in range(args.concurrency):
            engine.add(greedy(f"r{i}", [1 + (7 * i + j) % 200 for j in range(32)], 64))
        for _ in range(4):  # prefill, then decode steps
            engine.step()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        mean = (time.perf_counter() - start) / args.steps
        timeline = engine.runner.last_timeline
        engine.close()
    print(f"decode steps of {args.concurrency} sequences, --micro-batches "
          f"{args.micro_batches}, {args.delay_ms:g} ms one way: mean of {args.steps} "
          f"{1e3 * mean:.1f} ms")
    if timeline is None:
        return  # not pipelined: no timeline
    print("\nthe last one (ms from its first interval):\n")
    print("| micro-batch | " + " | ".join(
        f"layer {layer}" for layer in range(args.layers)) + " |")
    print("|---:|" + "---|" * args.layers)
    t0 = timeline.intervals[0].start
    for j in timeline.micro_batches():
        cells = []
        for layer in range(args.layers):
            a, x = (timeline.find(kind, j, layer) for kind in ("attention", "exchange"))
            cells.append(f"computes {1e3 * (a.start - t0):.1f}-{1e3 * (a.end - t0):.1f}, "
                         f"exchange to {1e3 * (x.end - t0):.1f} (held {1e3 * x.held:.1f})")
        print(f"| {j} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
