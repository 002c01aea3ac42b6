"""The grouped CPU expert kernels of this tree against those of another commit, in one run.

    .venv/bin/python -m benchmarks.kernel_ab --baseline HEAD~1 [--batches 1 4 16 64]

Builds the baseline's `moe_kernels/csrc/` (from git, under its own extension name) beside
this tree's, then times one decode step's worth of expert calls of each in turn, round by
round: the mid-size checkpoint's experts (32 of hidden 1024, intermediate 768, top-4),
`--layers` layers of random weights so that they are cold in cache as in a step, each
batch's routing drawn at random. Float32 and W4A4, each kernel's weights in the layout it
reads (panels where the module makes them). Reports the median time per layer, this tree
over the baseline, and the largest difference between their outputs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from moe_kernels.cpu_kernels import SOURCES, cpu_kernels
from moe_kernels.mxfp4 import MXFP4Tensor, quantize
from moe_kernels.panels import to_panels
from moe_kernels.selection import quantize_fused

CSRC = "moe_kernels/csrc"


def build_baseline(rev: str, into: Path) -> ModuleType:
    """The kernels of commit `rev`, built from its sources into `into`."""
    from torch.utils.cpp_extension import load

    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{CSRC}"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        source = subprocess.run(["git", "show", f"{rev}:{CSRC}/{name}"], check=True,
                                capture_output=True).stdout
        (into / name).write_bytes(source)
    sources = [str(into / s.name) for s in SOURCES if (into / s.name).exists()]
    print(f"building {rev}'s kernels ({len(sources)} sources) ...", flush=True)
    return load(f"switchyard_kernels_ab_{abs(hash(rev)) % 10**8}", sources,
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
                extra_ldflags=["-fopenmp"], build_directory=str(into))


def w4a4_layout(module: ModuleType, w: MXFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w as `module` reads it: its panels where it makes them, else as stored."""
    if hasattr(module, "w4a4_panels"):
        return module.w4a4_panels(w.packed, w.scales)
    return w.packed, w.scales


def timed_rounds(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each call, taken in turn each round."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a git revision to compare against")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    ours = cpu_kernels()
    if ours is None:
        sys.exit("the compiled CPU kernels are not available here (see the warning above)")
    with tempfile.TemporaryDirectory() as tmp:
        base = build_baseline(args.baseline, Path(tmp))
    g = torch.Generator().manual_seed(0)
    e, h, i = 32, 1024, 768
    print(f"making {args.layers} layers of weights ...", flush=True)
    f32 = [(to_panels(torch.randn(e, 2 * i, h, generator=g) / h**0.5).panels,
            to_panels(torch.randn(e, h, i, generator=g) / i**0.5).panels)
           for _ in range(args.layers)]
    mx = [(quantize(torch.randn(e, 2 * i, h, generator=g) / h**0.5),
           quantize(torch.randn(e, h, i, generator=g) / i**0.5)) for _ in range(args.layers)]
    layouts = {m: [(*w4a4_layout(m, gu), *w4a4_layout(m, d)) for gu, d in mx]
               for m in (base, ours)}
    print("\n| experts | tokens per step | baseline ms per layer | this tree ms per layer "
          "| this tree / baseline | largest output difference |")
    print("|---|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        ids = torch.stack([torch.randperm(e, generator=g)[:4] for _ in range(batch)]).flatten()
        counts = torch.bincount(ids, minlength=e).tolist()
        x = torch.randn(sum(counts), h, generator=g)
        q = quantize_fused(x)

        def run_f32(m: ModuleType, x: torch.Tensor = x, c: list[int] = counts) -> torch.Tensor:
            return [m.grouped_swiglu_f32(x, c, *w)[0] for w in f32][-1]

        def run_w4a4(m: ModuleType, q: MXFP4Tensor = q, c: list[int] = counts) -> torch.Tensor:
            return [m.grouped_swiglu_w4a4(q.packed, q.scales, c, *w)[0]
                    for w in layouts[m]][-1]

        for name, run in (("float32", run_f32), ("W4A4", run_w4a4)):
            diff = (run(base) - run(ours)).abs().max().item()
            t = timed_rounds({"base": lambda r=run: r(base), "ours": lambda r=run: r(ours)},
                             args.rounds)
            b, o = (1e3 * t[k] / args.layers for k in ("base", "ours"))
            print(f"| {name} | {batch} | {b:.3f} | {o:.3f} | {o / b:.2f}x | {diff:.1e} |",
                  flush=True)


if __name__ == "__main__":
    main()
