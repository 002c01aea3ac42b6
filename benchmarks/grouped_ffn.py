""".venv/bin/python -m benchmarks.grouped_ffn [--repeat 7]

Float expert FFN on the CPU, expert by expert vs. two `torch._grouped_mm` calls.

CPU expert banks run the per-expert loop, each expert timed on its own (the dashboard's
per-expert latency); CUDA banks run the grouped GEMMs where they agree. This measures
what the loop costs here. Shapes: the bundled demo model's experts (8 x 128 x 256), the
mid-size checkpoint's (8 x 1024 x 768) and 64 experts of 1024 x 512; routed rows drawn
uniformly over the experts (uneven counts, some empty), float32. Median of --repeat runs
after one warm-up, the two paths alternating; both give the same bits (checked).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial

import torch

from benchmarks.timing import timed
from moe_kernels.grouped_gemm import grouped_swiglu, grouped_swiglu_mm

SHAPES = [(8, 128, 256), (8, 1024, 768), (64, 1024, 512)]  # experts, hidden, inter
ROWS = [16, 128, 1024]  # routed rows per call (tokens x top-k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| experts | hidden | inter | rows | per-expert loop ms | grouped ms | grouped / loop |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for e, h, i in SHAPES:
        w_gate_up = torch.randn(e, 2 * i, h, generator=g) / h**0.5
        w_down = torch.randn(e, h, i, generator=g) / i**0.5
        for n in ROWS:
            counts = torch.randint(0, e, (n,), generator=g).bincount(minlength=e).tolist()
            x = torch.randn(n, h, generator=g)
            if not torch.equal(grouped_swiglu(x, counts, w_gate_up, w_down),
                               grouped_swiglu_mm(x, counts, w_gate_up, w_down)):
                sys.exit(f"the two paths differ at {e}x{h}x{i}, {n} rows")
            runs = {path: partial(path, x, counts, w_gate_up, w_down)
                    for path in (grouped_swiglu, grouped_swiglu_mm)}
            loop, grouped = [], []
            for _ in range(args.repeat):  # alternate, so drift hits both alike
                loop.append(timed(runs[grouped_swiglu], 1))
                grouped.append(timed(runs[grouped_swiglu_mm], 1))
            a, b = statistics.median(loop) * 1e3, statistics.median(grouped) * 1e3
            print(f"| {e} | {h} | {i} | {n} | {a:.2f} | {b:.2f} | {b / a:.2f} |", flush=True)


if __name__ == "__main__":
    main()
