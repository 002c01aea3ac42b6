""".venv/bin/python -m benchmarks.w4a4_cpu [--experts 8] [--hidden 1024] [--inter 768]

Grouped expert FFN on the CPU: W4A4 and float32 through the compiled CPU kernels, and
the torch paths (W4A4 decoded to float32, float32, bfloat16).

Eight local experts of the mid-size checkpoint's shape, each kernel's weights in its panel
layout (`moe_kernels.panels`, as the experts hold them); every expert gets the same number
of tokens: decode shapes (1 to 64 tokens per expert) and a prefill shape (512). The W4A4
time includes quantizing the activations (what the attention side does before dispatch)
and re-quantizing the SwiGLU output; weights are quantized once, outside the timing.
Median of --repeat runs after one warm-up; bf16 gets fewer repeats (it is ~100x slower
on CPUs without AVX-512 BF16).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks.timing import timed
from moe_kernels.cpu_kernels import cpu_kernels
from moe_kernels.grouped_gemm import grouped_swiglu, grouped_swiglu_w4a4
from moe_kernels.mxfp4 import quantize
from moe_kernels.panels import to_panels
from moe_kernels.selection import (
    cpu_grouped_swiglu,
    cpu_grouped_swiglu_w4a4,
    panels_for_cpu,
    quantize_fused,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if cpu_kernels() is None:
        sys.exit("the compiled CPU kernels are not available here (see the warning above)")
    g = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    w_gate_up = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w_down = torch.randn(e, h, i, generator=g) / i**0.5
    q_gate_up, q_down = quantize(w_gate_up), quantize(w_down)
    p_gate_up, p_down = to_panels(w_gate_up), to_panels(w_down)  # the float32 kernel's layout
    mp_gate_up, mp_down = panels_for_cpu(q_gate_up), panels_for_cpu(q_down)  # the W4A4 one's
    w16 = (w_gate_up.bfloat16(), w_down.bfloat16())
    weight_bytes = {"float32": 4 * 3 * e * h * i, "bfloat16": 2 * 3 * e * h * i,
                    "w4a4": q_gate_up.nbytes() + q_down.nbytes()}
    print(f"{e} experts, hidden {h}, intermediate {i}, {torch.get_num_threads()} threads; "
          f"expert weights: float32 {weight_bytes['float32'] / 1e6:.1f} MB, bf16 "
          f"{weight_bytes['bfloat16'] / 1e6:.1f} MB, MXFP4 {weight_bytes['w4a4'] / 1e6:.1f} MB")
    print("\n| tokens per expert | float32 kernel ms | W4A4 kernel ms | W4A4 / float32, kernels "
          "| float32 torch ms | bf16 torch ms | W4A4 torch ms | W4A4 / float32, torch |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in args.tokens:
        counts = [t] * e
        x = torch.randn(t * e, h, generator=g)
        x16 = x.bfloat16()
        print(f"{t} tokens per expert ...", file=sys.stderr, flush=True)
        f32 = timed(lambda x=x, c=counts: grouped_swiglu(x, c, w_gate_up, w_down),
                    args.repeat, statistics.median)
        b16 = timed(lambda x=x16, c=counts: grouped_swiglu(x, c, *w16),
                    max(1, args.repeat // 5), statistics.median)
        w4 = timed(lambda x=x, c=counts: grouped_swiglu_w4a4(quantize(x), c, q_gate_up, q_down),
                   args.repeat, statistics.median)
        f32k = timed(lambda x=x, c=counts: cpu_grouped_swiglu(x, c, p_gate_up, p_down, None),
                     args.repeat, statistics.median)
        w4k = timed(lambda x=x, c=counts: cpu_grouped_swiglu_w4a4(quantize_fused(x), c,
                                                                  mp_gate_up, mp_down, None),
                    args.repeat, statistics.median)
        print(f"| {t} | {1e3 * f32k:.2f} | {1e3 * w4k:.2f} | {w4k / f32k:.2f}x | "
              f"{1e3 * f32:.1f} | {1e3 * b16:.1f} | {1e3 * w4:.1f} | {w4 / f32:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
