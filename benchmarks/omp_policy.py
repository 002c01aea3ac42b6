"""What OpenMP's sleeping workers cost a decode step: one process served with OpenMP's
default wait policy (idle workers spin a while) and with `OMP_WAIT_POLICY=PASSIVE` (they
sleep at once: every parallel region wakes them), beside the default topology (attention
+ 2 `rpc` expert services), which `switchyard serve` runs PASSIVE because its processes
share the cores. Configurations alternate round by round.

    .venv/bin/python -m benchmarks.omp_policy [--concurrency 1] [--rounds 2]
                                              [--output-len 64]

The mid-size checkpoint of `benchmarks.generate`, float32, 128 input tokens; prints each
configuration's own mean decode step (`switchyard:engine_step_seconds`) per round.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.generate import add_workdir_flag, build_checkpoint
from benchmarks.serving import served_rows
from switchyard.bench import make_prompts

CONFIGS = [("1 process, OpenMP default", ["--dispatch-backend", "local"], None),
           ("1 process, OMP_WAIT_POLICY=PASSIVE", ["--dispatch-backend", "local"], "PASSIVE"),
           ("default topology (PASSIVE)", ["--dispatch-backend", "rpc",
                                           "--expert-services", "2"], None)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workdir_flag(ap)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    path = build_checkpoint(args.workdir)
    prompts = make_prompts(max(max(args.concurrency), 4), 128, 0.0, 200, seed=0)
    steps: dict[str, dict[int, list[float]]] = {name: {} for name, _, _ in CONFIGS}
    for _ in range(args.rounds):
        for name, flags, policy in CONFIGS:
            os.environ.pop("OMP_WAIT_POLICY", None)  # serve sets PASSIVE for a topology
            if policy:
                os.environ["OMP_WAIT_POLICY"] = policy
            rows = served_rows(path, flags, prompts, args.concurrency, args.output_len)
            for c, row in rows.items():
                steps[name].setdefault(c, []).append(row["step_ms"])
    print("| configuration | concurrency | own decode step ms, per round |")
    print("|---|---:|---|")
    for name, by_level in steps.items():
        for c, ms in by_level.items():
            print(f"| {name} | {c} | {', '.join(f'{m:.1f}' for m in ms)} |")


if __name__ == "__main__":
    main()
