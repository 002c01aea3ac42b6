"""One decode step's timeline with the experts behind a wire delay (issue 49): when each
micro-batch's attention runs, when its layer call leaves, and how long it waits for the
answers, on the attention service's step thread.

    .venv/bin/python -m benchmarks.timeline [--delay-ms 5] [--micro-batches 2]
                                            [--concurrency 16] [--layers 3]

An attention engine in this process (the mid-size checkpoint, `rpc`) calls two expert
services through delaying proxies (`benchmarks.wire`); 16 sequences decode a few steps,
then `--steps` are timed and the last one recorded: per MoE layer, when each
micro-batch's call left, when its `finish` began waiting, and when its answers were read,
in milliseconds from the step's start. A pipeline that hides the wire shows one
micro-batch's compute inside the other's flight. (It runs itself again with
OMP_WAIT_POLICY=PASSIVE, as `serve` runs its services.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.generate import add_workdir_flag, build_checkpoint
from benchmarks.wire import delayed_experts
from common.rpc import parse_address
from ep_dispatch import rpc
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from tests.support.engines import greedy

Event = tuple[float, str, int, int]  # (seconds, what, micro-batch, layer)


def recorded(events: list[Event]) -> None:
    """Record, on the step thread, each exchange's start and its finish's wait (a layer's
    micro-batches numbered in the order their calls leave)."""
    start, finish = rpc.RpcExperts.start, rpc.RpcExchange.finish

    def timed_start(self: rpc.RpcExperts, layer: int, *rest: object) -> rpc.RpcExchange:
        exchange = start(self, layer, *rest)  # type: ignore[arg-type]
        j = sum(1 for e in events if e[1] == "sent" and e[3] == layer)
        events.append((time.perf_counter(), "sent", j, layer))
        exchange.number = j  # type: ignore[attr-defined]
        return exchange

    def timed_finish(self: rpc.RpcExchange) -> object:
        j = getattr(self, "number", 0)
        events.append((time.perf_counter(), "wait", j, self.layer))
        out = finish(self)
        events.append((time.perf_counter(), "answered", j, self.layer))
        return out

    rpc.RpcExperts.start = timed_start  # type: ignore[method-assign]
    rpc.RpcExchange.finish = timed_finish  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workdir_flag(ap)
    ap.add_argument("--delay-ms", type=float, default=5.0)
    ap.add_argument("--micro-batches", default="2")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--layers", type=int, default=3, help="MoE layers to print")
    ap.add_argument("--steps", type=int, default=10, help="decode steps timed (mean)")
    args = ap.parse_args()
    if os.environ.get("OMP_WAIT_POLICY") != "PASSIVE":  # as `serve` runs its services:
        # OpenMP's spin-waiting here would take the cores the expert services need
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.timeline",
                                   *sys.argv[1:]], {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    path = build_checkpoint(args.workdir)
    events: list[Event] = []
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
        for _ in range(args.steps - 1):
            engine.step()
        recorded(events)
        t0 = time.perf_counter()
        engine.step()
        mean = (time.perf_counter() - start) / args.steps
        engine.close()
    print(f"decode steps of {args.concurrency} sequences, --micro-batches "
          f"{args.micro_batches}, {args.delay_ms:g} ms one way: mean of {args.steps} "
          f"{1e3 * mean:.1f} ms; the last one:\n")
    print("| ms from the step's start | micro-batch | layer | event |")
    print("|---:|---:|---:|---|")
    layers = sorted({e[3] for e in events})[:args.layers]
    for t, what, j, layer in events:
        if layer in layers:
            print(f"| {1e3 * (t - t0):.1f} | {j} | {layer} | {what} |")


if __name__ == "__main__":
    main()
