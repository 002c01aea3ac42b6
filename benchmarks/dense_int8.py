""".venv/bin/python -m benchmarks.dense_int8 [--rows 1 4 16 64] [--rounds 5]

The dense linear over int8 weights against float32, in process, side by side.

For the mid-size checkpoint's shapes (`benchmarks.generate`: hidden 1024; an attention
projection [1024, 1024], a dense MLP's gate and up [2 x 2816, 1024] and the lm_head
[32000, 1024]: the last the largest single read of a decode step), `moe_kernels.selection
.linear` over float32 panels and over int8 panels (`moe_kernels.int8`) at each row count;
the two alternate for `--rounds` rounds of `--calls` calls, medians reported, with the
weight bytes each reads and the bandwidth that makes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.serving import log
from moe_kernels.int8 import int8_panels
from moe_kernels.panels import to_panels
from moe_kernels.selection import linear

SHAPES = {"attention projection": (1024, 1024), "dense MLP gate+up": (5632, 1024),
          "lm_head": (32000, 1024)}


def timed(x: torch.Tensor, w: object, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        linear(x, w)  # type: ignore[arg-type]
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print("| weight [N, K] | rows | float32 (ms) | int8 (ms) | int8 vs float32 | "
          "float32 GB/s | int8 GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g) * 0.02
        f32, i8 = to_panels(w, pad=True), int8_panels(w)
        for m in args.rows:
            log(f"{name} at {m} rows ...")
            x = torch.randn(m, k, generator=g)
            for weights in (f32, i8):
                timed(x, weights, 3)  # warm
            runs: dict[str, list[float]] = {"f32": [], "i8": []}
            for _ in range(args.rounds):
                runs["f32"].append(timed(x, f32, args.calls))
                runs["i8"].append(timed(x, i8, args.calls))
            a, b = statistics.median(runs["f32"]), statistics.median(runs["i8"])
            print(f"| {name} [{n}, {k}] | {m} | {1e3 * a:.3f} | {1e3 * b:.3f} | {b / a:.2f}x"
                  f" | {f32.nbytes() / a / 1e9:.1f} | {i8.nbytes() / b / 1e9:.1f} |")


if __name__ == "__main__":
    main()
