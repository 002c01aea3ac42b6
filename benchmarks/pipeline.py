""".venv/bin/python -m benchmarks.pipeline [--concurrency 1 16 64] [--micro-batches 2 auto]
                                        [--input-len 128] [--output-len 128]

The ping-pong pipeline in one run: the default topology (attention + 2 expert services over
`rpc`) with its step pipelined in micro-batches, the same topology without (one batch a
step), and one process, served through HTTP on the mid-size checkpoint.

Each configuration is a `switchyard serve` loaded by `switchyard bench`'s client at each
concurrency, the same fixed-seed prompts for all; float32, greedy, exactly
`--output-len` tokens a request. Reports output tokens/s, the median TPOT, the server's
own mean decode step (`switchyard:engine_step_seconds`), each side's busy fraction
(`switchyard:busy_seconds_total` over the load's wall time, per process: in one process
the experts' time is the attention service's), and the ratios:
pipelined over unpipelined, and each over one process.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.floor import machine
from benchmarks.generate import add_workdir_flag, build_checkpoint
from benchmarks.serving import served_rows
from switchyard.bench import make_prompts

ONE_PROCESS = ["--dispatch-backend", "local"]
EXPERT_SERVICES = 2
DEFAULT_TOPOLOGY = ["--dispatch-backend", "rpc", "--expert-services", str(EXPERT_SERVICES)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workdir_flag(ap)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--micro-batches", nargs="+", default=["2"],
                    choices=["auto", "2", "3"], help="the pipelined settings to compare")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    path = build_checkpoint(args.workdir)
    levels = args.concurrency
    prompts = make_prompts(max(max(levels), 4), args.input_len, 0.0, 200, seed=0)
    m = machine()
    configs = [("1 process", ONE_PROCESS),
               ("default topology, --micro-batches 1", [*DEFAULT_TOPOLOGY,
                                                        "--micro-batches", "1"])]
    configs += [(f"default topology, --micro-batches {s}",
                 [*DEFAULT_TOPOLOGY, "--micro-batches", s]) for s in args.micro_batches]
    rows = {}
    for name, flags in configs:
        print(f"{name}: starting ...", file=sys.stderr, flush=True)
        rows[name] = served_rows(path, flags, prompts, levels, args.output_len)
    print(f"machine: read {m['read_gbs']:.1f} GB/s, float32 matmul "
          f"{m['matmul_gflops']:.0f} GFLOP/s; {args.input_len} input + {args.output_len} "
          "output tokens, float32\n")
    print("| concurrency | configuration | out tok/s | TPOT median ms | own decode step ms "
          "| attention busy | each expert service busy | vs 1 process | vs --micro-batches 1 |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    one, unpiped = configs[0][0], configs[1][0]
    for c in levels:
        for name, _ in configs:
            r = rows[name][c]
            tps = r["output_throughput"]
            vs_one = tps / rows[one][c]["output_throughput"]
            vs_unpiped = tps / rows[unpiped][c]["output_throughput"]
            wall = r["duration_s"]
            attention = r["busy_s"].get("attention", 0.0) / wall
            experts = r["busy_s"].get("expert", 0.0) / wall / EXPERT_SERVICES
            print(f"| {c} | {name} | {tps:.1f} | {r['tpot']['median_ms']:.1f} | "
                  f"{r['step_ms']:.1f} | {attention:.0%} | "
                  + (f"{experts:.0%}" if name != one else "-")
                  + f" | {vs_one:.2f}x | " + (f"{vs_unpiped:.2f}x |" if name != one else "- |"))


if __name__ == "__main__":
    main()
