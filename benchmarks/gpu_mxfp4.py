""".venv/bin/python -m benchmarks.gpu_mxfp4 [--experts 64] [--hidden 4096] [--inter 2048]
    [--sweep [JSON]] [--write-config [PATH]]

Triton W4A4 MXFP4 grouped GEMM on an NVIDIA GPU (H100/H200): correctness, then speed.

Exits 0 with a message when no CUDA device is present (so it is safe anywhere).

1. Checks `moe_kernels.triton_mxfp4.grouped_mxfp4_gemm` (each variant: the inner products
   `tl.dot_scaled`, in-kernel decode + TF32 or bf16 `tl.dot`, float16 codes per 32-block,
   bfloat16 operands decoded by inline PTX from the bf16x2 weight layout;
   each with activations or weights as the MMA's left operand, and split over K on the
   dense grid) against the torch path
   (`mxfp4_linear` per expert, in IEEE float32: TF32 is switched off) on a small shape and
   on a slice of the full shape, with uneven and empty experts; and
   `grouped_swiglu_w4a4_triton` against `grouped_swiglu_w4a4`.
2. Measures HBM copy bandwidth: `dst.copy_(src)` of a 4 GiB tensor, counting the bytes read
   plus the bytes written.
3. Times the gate_up GEMM (`[E, 2I, H]`, K = H) and the down GEMM (`[E, H, I]`, K = I) at
   decode (1, 4, 16, 64 tokens per expert) and prefill (512, 2048) shapes, every expert
   getting the same number of tokens: Triton (per variant) vs. bf16 torch on the same data
   dequantized to bf16: `torch._grouped_mm` when it runs and matches (what CUDA expert
   banks run), and the per-expert `torch.mm` loop; and W4A4 by another route, both
   operands decoded to bf16 in one pass each (`dequantize_mxfp4`) then `torch._grouped_mm`,
   the decoding timed with it. CUDA events around each call, L2
   flushed before each, warm-up, median of --iters. Triton gets `max_rows` (the expert
   service knows its counts), so no tile schedule is built; the activations are quantized
   outside the timing.

4. With `--sweep`: tile sizes, launch options and split_k of the "dot_scaled", "f16",
   "f16x2" and "bf16x2" variants at 1, 16 and 512 tokens per expert (`sweep`); with `--write-config`
   the fastest per tokens per expert becomes this GPU's tuned table
   (`moe_kernels/configs/<device>.json`, which the expert service runs; step 3 times it as
   "triton tuned").

Table: median time; weight TB/s = weight bytes / time (MXFP4: packed + scales; bf16: 2 bytes
per weight; activations and outputs are not counted, so at prefill this understates traffic);
that as a fraction of the copy bandwidth; TFLOP/s = 2 N M K / time.

Weights are random bytes (codes) with E8M0 scales 2**-9..2**-5, i.e. valid MXFP4 of the
magnitude of real expert weights; the kernel's speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # imported where used: the module must import without Triton
    from moe_kernels.bf16x2_layout import Bf16x2Weights
    from moe_kernels.kernel_configs import KernelConfig
    from moe_kernels.mxfp4 import MXFP4Tensor

VARIANTS = [f"{inner}{swap}" for inner in ("dot_scaled", "decode", "bf16", "f16", "f16x2",
                                           "bf16x2") for swap in ("", "/swap")]
# the inner products the sweep tries (the others lost in runs 2 and 3)
SWEPT = ("dot_scaled", "f16", "f16x2", "bf16x2")
ROUTE = "bf16_grouped_mm"  # the sweep's name for KernelConfig(route="bf16_grouped_mm")


def config_label(config: KernelConfig) -> str:  # e.g. "f16/swap (16, 256, 32, 4, 5, 1)"
    if config.route != "triton":
        return config.route
    return (f"{config.inner}{'/swap' if config.swap_ab else ''} ({config.block_n}, "
            f"{config.block_m}, {config.block_k}, {config.num_warps}, {config.num_stages}, "
            f"{config.split_k})")


def weights_for(w: MXFP4Tensor, variant: str, layouts: dict[int, tuple]
                ) -> MXFP4Tensor | Bf16x2Weights:
    """w in the layout `variant` reads: "bf16x2" variants read their own
    (`moe_kernels.bf16x2_layout`), made once per weight tensor into `layouts`, a cache
    the caller keeps (which also keeps w alive, so its id stays its own)."""
    from moe_kernels.bf16x2_layout import to_bf16x2

    if variant.partition("/")[0] != "bf16x2":
        return w
    if id(w) not in layouts:
        layouts[id(w)] = (w, to_bf16x2(w))
    return layouts[id(w)][1]


def variant_options(variant: str) -> dict[str, object]:
    """`grouped_mxfp4_gemm` keywords of a variant name: "bf16/swap" -> inner, swap_ab."""
    inner, _, swap = variant.partition("/")
    return {"inner": inner, "swap_ab": swap == "swap"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=4096, help="H (e.g. 4096 or 7168)")
    ap.add_argument("--inter", type=int, default=2048, help="I, the expert intermediate size")
    ap.add_argument("--decode", type=int, nargs="*", default=[1, 4, 16, 64],
                    help="decode shapes: tokens per expert")
    ap.add_argument("--prefill", type=int, nargs="*", default=[512, 2048],
                    help="prefill shapes: tokens per expert")
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS,
                    help="inner product, then /swap for weights as the left operand")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--copy-gib", type=float, default=4.0, help="size of the copy test")
    ap.add_argument("--skip-check", action="store_true", help="skip the correctness checks")
    ap.add_argument("--sweep", metavar="JSON", nargs="?", const="", default=None,
                    help="then sweep tiles, launch options and split_k (`sweep`), writing "
                         "every timing to JSON if given")
    ap.add_argument("--write-config", metavar="PATH", nargs="?", const="", default=None,
                    help="with --sweep: write the fastest config per tokens per expert for "
                         "this GPU (default: moe_kernels/configs/<device>.json)")
    return ap.parse_args(argv)


def random_mxfp4(e: int, m: int, k: int, device: str, seed: int) -> MXFP4Tensor:
    from moe_kernels.mxfp4 import MXFP4Tensor

    g = torch.Generator(device=device).manual_seed(seed)
    packed = torch.randint(0, 256, (e, m, k // 2), dtype=torch.uint8, device=device,
                           generator=g)  # [E, M, K/2]
    scales = torch.randint(118, 123, (e, m, k // 32), dtype=torch.uint8, device=device,
                           generator=g)  # [E, M, K/32]: 2**-9 .. 2**-5
    return MXFP4Tensor(packed, scales)


def to_bf16(w: MXFP4Tensor) -> torch.Tensor:  # [E, M, K] -> [E, M, K] bf16, by expert
    from moe_kernels.mxfp4 import dequantize

    e, m, k = w.shape
    out = torch.empty(e, m, k, dtype=torch.bfloat16, device=w.packed.device)
    for i in range(e):
        out[i] = dequantize(w[i], torch.bfloat16)  # exact: MXFP4 values fit bf16
    return out


def offsets_of(counts: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device=device)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (NaN-free inputs)."""
    return ((actual.float() - expected.float()).abs().max()
            / expected.float().abs().max().clamp_min(1e-30)).item()


# H, I and tokens per expert of check's first shape: uneven counts, two experts empty.
UNEVEN = (512, 256, [0, 5, 33, 1, 0, 70])


def check(args: argparse.Namespace, variants: list[str], device: str = "cuda"
          ) -> tuple[bool, list[str]]:
    """Triton vs. the torch path; returns (all passed, the variants that ran and passed
    everywhere, with `ROUTE` among them if the bf16 route did): only those are swept."""
    from moe_kernels.grouped_gemm import grouped_swiglu, grouped_swiglu_w4a4, mxfp4_linear
    from moe_kernels.kernel_configs import KernelConfig
    from moe_kernels.mxfp4 import dequantize, quantize
    from moe_kernels.triton_mxfp4 import (
        grouped_mxfp4_gemm,
        grouped_swiglu_w4a4_bf16,
        grouped_swiglu_w4a4_triton,
    )

    torch.backends.cuda.matmul.allow_tf32 = False  # the torch path in IEEE float32
    ok, working, route_ok = True, list(variants), True
    layouts: dict[int, tuple] = {}
    shapes = [UNEVEN, (args.hidden, args.inter, [1, 0, 64, 200])]
    print("## Correctness (Triton vs. torch path)\n")
    print("| H | I | tokens per expert | GEMM | variant | max rel err | bit-exact | result |")
    print("|---:|---:|---|---|---|---:|---:|---|")
    for h, i, counts in shapes:
        e, n = len(counts), sum(counts)
        offsets = offsets_of(counts, device)
        x = quantize(torch.randn(n, h, device=device))
        w_gate_up = random_mxfp4(e, 2 * i, h, device, seed=1)
        w_down = random_mxfp4(e, h, i, device, seed=2)
        act = quantize(torch.randn(n, i, device=device))
        for name, xq, w in (("gate_up", x, w_gate_up), ("down", act, w_down)):
            ref = torch.empty(n, w.shape[1], device=device)
            start = 0
            for expert, count in enumerate(counts):
                ref[start:start + count] = mxfp4_linear(xq[start:start + count], w[expert])
                start += count
            for variant in list(working):
                try:
                    out = grouped_mxfp4_gemm(xq, offsets, weights_for(w, variant, layouts),
                                             **variant_options(variant))
                    if device == "cuda":
                        torch.cuda.synchronize()
                except Exception as exc:  # e.g. dot_scaled e2m1 x e2m1 unsupported here
                    print(f"| {h} | {i} | {counts} | {name} | {variant} | - | - | "
                          f"{failure(exc)} |")
                    working.remove(variant)
                    ok = False
                    continue
                err = rel_err(out, ref)
                exact = torch.equal(out, ref)
                passed = err <= 1e-5
                ok &= passed
                print(f"| {h} | {i} | {counts} | {name} | {variant} | {err:.2e} | "
                      f"{'yes' if exact else 'no'} | {'ok' if passed else 'FAIL'} |")
                if not passed:  # wrong here: never swept, never tuned in
                    working.remove(variant)
            for variant in list(working):  # K split over 3 programs, on the dense grid
                label = f"{h} | {i} | {counts} | {name} | {variant}, split_k 3, dense"
                try:  # another compile: any failure drops this variant only
                    out = grouped_mxfp4_gemm(xq, offsets, weights_for(w, variant, layouts),
                                             max_rows=max(counts), split_k=3,
                                             **variant_options(variant))
                    err = rel_err(out, ref)
                except Exception as exc:
                    print(f"| {label} | - | - | {failure(exc)} |")
                    err = float("inf")
                else:
                    print(f"| {label} | {err:.2e} | {'yes' if torch.equal(out, ref) else 'no'}"
                          f" | {'ok' if err <= 1e-5 else 'FAIL'} |")
                ok &= err <= 1e-5
                if err > 1e-5:
                    working.remove(variant)
        for variant in ("dot_scaled", "bf16x2/swap"):  # the whole FFN: the default, and
            if variant not in working:  # the variant with weights in their own layout
                continue
            config = KernelConfig(**variant_options(variant))  # type: ignore[arg-type]
            try:  # the first run of the quantize kernel between the GEMMs, too
                out = grouped_swiglu_w4a4_triton(x, counts, w_gate_up, w_down, config)
                ref = grouped_swiglu_w4a4(x, counts, w_gate_up, w_down).to(out.device)
            except Exception as exc:
                print(f"| {h} | {i} | {counts} | swiglu | {variant} | - | - | "
                      f"{failure(exc)} |")
                ok = False
                working.remove(variant)
                continue
            err = rel_err(out, ref)
            # Re-quantizing between the GEMMs turns float32 rounding differences in the
            # first GEMM into occasional one-code flips, so this bound is looser.
            passed = err <= 1e-2
            ok &= passed
            print(f"| {h} | {i} | {counts} | swiglu | {variant} | {err:.2e} | "
                  f"{'yes' if torch.equal(out, ref) else 'no'} | "
                  f"{'ok' if passed else 'FAIL'} |")
            if not passed:
                working.remove(variant)
        try:  # the route through bf16 grouped GEMMs: bf16-rounded GEMM outputs, so a
            # re-quantized code flips now and then: as close to the float FFN of the same
            # operands as the torch path is (tests/moe_kernels/test_triton_mxfp4.py)
            out = grouped_swiglu_w4a4_bf16(x, counts, w_gate_up, w_down)
            ref = grouped_swiglu_w4a4(x, counts, w_gate_up, w_down).to(out.device)
            ffn = grouped_swiglu(dequantize(x), counts, dequantize(w_gate_up),
                                 dequantize(w_down)).to(out.device)
            err, bound = norm_err(out, ffn), 1.05 * norm_err(ref, ffn)
            ok &= err <= bound
            route_ok &= err <= bound
            print(f"| {h} | {i} | {counts} | swiglu | bf16 dequant + torch._grouped_mm | "
                  f"{err:.3f} vs float (torch path {bound / 1.05:.3f}) | no | "
                  f"{'ok' if err <= bound else 'FAIL'} |")
        except Exception as exc:  # torch._grouped_mm unsupported here, or a compile error
            route_ok = False
            print(f"| {h} | {i} | {counts} | swiglu | bf16 dequant + torch._grouped_mm | - | "
                  f"- | {failure(exc)} |")
    print()
    try:  # a failure here is reported; the GEMM variants that passed are kept
        ok &= check_quantize(device)
    except Exception as exc:
        print(f"quantize kernel: {failure(exc)}\n")
        ok = False
    try:
        tiny_scales(device, [v for v in working if v.startswith("bf16x2")])
    except Exception as exc:  # information only
        print(f"bf16x2 on the smallest scales: {failure(exc)}\n")
    return ok, working + [ROUTE] * route_ok


def failure(exc: Exception) -> str:
    """A table cell for a step that raised."""
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"FAILED TO RUN: {type(exc).__name__}: {first}"


def tiny_scales(device: str, variants: list[str]) -> None:
    """bf16x2 on weights of the smallest scales (bytes 0-8: values down to 2**-128, bf16
    subnormals before and after the decode's multiply) against the torch path, with
    activations large enough that every product is a normal float32. Reported, not
    required: real weights are never this small, and it does not drop the variant."""
    from moe_kernels.grouped_gemm import mxfp4_linear
    from moe_kernels.mxfp4 import MXFP4Tensor, quantize
    from moe_kernels.triton_mxfp4 import grouped_mxfp4_gemm

    if not variants:
        return
    g = torch.Generator(device=device).manual_seed(7)
    w = random_mxfp4(2, 64, 256, device, seed=8)
    w = MXFP4Tensor(w.packed, torch.randint(0, 9, w.scales.shape, dtype=torch.uint8,
                                            device=device, generator=g))
    xq = quantize(torch.randn(5, 256, device=device, generator=g) * 2.0**100)
    counts, layouts = [2, 3], {}
    ref = torch.cat([mxfp4_linear(xq[:2], w[0]), mxfp4_linear(xq[2:], w[1])])
    print("| weights | variant | max rel err | bit-exact |\n|---|---|---:|---:|")
    for variant in variants:
        out = grouped_mxfp4_gemm(xq, offsets_of(counts, device), weights_for(w, variant, layouts),
                                 **variant_options(variant))
        print(f"| scale bytes 0-8 | {variant} | {rel_err(out, ref):.2e} | "
              f"{'yes' if torch.equal(out, ref) else 'no'} |")
    print()


def check_quantize(device: str) -> bool:
    """The activations' quantize kernel (`quantize_mxfp4`, what `quantize_fused` runs on
    CUDA) against the torch quantizer, byte for byte, on float32 and bfloat16 rows of
    magnitudes from float32 denormals up; then both timed at decode and prefill rows of
    hidden 7168 (CUDA only)."""
    from moe_kernels.mxfp4 import quantize
    from moe_kernels.triton_mxfp4 import quantize_mxfp4

    if quantize_mxfp4 is quantize:  # gpu_check's preflight replaced the failed kernel
        print("quantize kernel: not run here, it failed the preflight\n")
        return False
    g = torch.Generator(device=device).manual_seed(5)
    n = 256 if device == "cuda" else 8  # the interpreter (tests) takes 5 s per 64 rows
    x = torch.randn(n, 7168, device=device, generator=g) * torch.exp2(torch.randint(
        -150, 120, (n, 1), device=device, generator=g).float())
    ok = True
    print("| activations | dtype | quantize kernel vs torch | result |\n|---|---|---|---|")
    for t in (x, x.bfloat16()):
        want, got = quantize(t), quantize_mxfp4(t)
        same = torch.equal(got.packed, want.packed) and torch.equal(got.scales, want.scales)
        normal = x.abs().amax(dim=1) >= 2**-126  # rows without a denormal maximum
        same_normal = torch.equal(got.packed[normal], want.packed[normal])
        ok &= same
        verdict = "bit-exact" if same else \
            f"differs (rows of normal magnitude: {'equal' if same_normal else 'differ'})"
        print(f"| [{n}, 7168], 2**-150..2**120 | {t.dtype} | {verdict} | "
              f"{'ok' if same else 'FAIL'} |")
    print()
    if device == "cuda":
        # Per call from an idle GPU, launches included: what an eager decode step pays.
        print("| rows x 7168 bf16 | torch quantize us | quantize kernel us |\n|---:|---:|---:|")
        for n in (32, 256, 4096):
            rows = torch.randn(n, 7168, dtype=torch.bfloat16, device=device)
            print(f"| {n} | {time_ms(partial(quantize, rows), 3, 10, None) * 1e3:.1f} | "
                  f"{time_ms(partial(quantize_mxfp4, rows), 3, 10, None) * 1e3:.1f} |")
        print()
    return ok


def norm_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||: for results where a few elements may flip."""
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def copy_bandwidth(gib: float) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = int(gib * 2**30) // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda").fill_(1.0)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=3, iters=10, flush=None)
    return 2 * n * 4 / (ms * 1e-3)


def time_ms(fn: Callable[[], object], warmup: int, iters: int,
            flush: torch.Tensor | None) -> float:
    """Median milliseconds of fn over iters CUDA-event-timed calls, after warmup calls;
    `flush` (a large buffer) is overwritten before each timed call to empty the L2."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bf16_grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: list[int], offsets: torch.Tensor
                    ) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """bf16 grouped GEMMs x [N, K] by w [E, M, K] -> [N, M]: torch._grouped_mm if it runs
    and agrees with the per-expert loop, then the loop (what CPU expert banks run)."""

    def loop() -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[1], dtype=torch.bfloat16, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                torch.mm(x[start:start + count], w[expert].T, out=out[start:start + count])
                start += count
        return out

    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is not None:
        ends = offsets[1:].to(torch.int32)  # [E] cumulative row ends

        def grouped() -> torch.Tensor:
            return grouped_mm(x, w.transpose(-2, -1), offs=ends)

        try:
            if rel_err(grouped(), loop()) <= 1e-2:
                return [("torch._grouped_mm", grouped), ("per-expert torch.mm", loop)]
        except Exception:  # unsupported arch/layout/alignment in this torch build
            pass
    return [("per-expert torch.mm", loop)]


def _dequant_grouped_mm(xq: MXFP4Tensor, w: MXFP4Tensor, ends: torch.Tensor) -> torch.Tensor:
    """One GEMM by the "bf16_grouped_mm" route: both MXFP4 operands decoded to bf16 in one
    pass each, then `torch._grouped_mm` (ends: [E] int32 cumulative rows)."""
    from moe_kernels.triton_mxfp4 import dequantize_mxfp4

    return torch._grouped_mm(dequantize_mxfp4(xq), dequantize_mxfp4(w).transpose(-2, -1),
                             offs=ends)


def device_name(device: str) -> str:
    """The tuned-config key: the GPU model (`moe_kernels.kernel_configs`)."""
    return torch.cuda.get_device_name() if device == "cuda" else device


def l2_flush(device: str) -> torch.Tensor | None:
    """A buffer larger than any L2, overwritten before each timed call (CUDA only)."""
    return torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda") if device == "cuda" \
        else None


def bench(args: argparse.Namespace, variants: list[str], copy_bw: float,
          device: str = "cuda") -> None:
    from moe_kernels.kernel_configs import load_configs, pick
    from moe_kernels.mxfp4 import quantize
    from moe_kernels.triton_mxfp4 import grouped_mxfp4_gemm

    variants = [v for v in variants if v != ROUTE]  # timed below as its own row
    e, h, i = args.experts, args.hidden, args.inter
    tuned = load_configs(device_name(device))  # {}: this GPU has no tuned file
    layouts: dict[int, tuple] = {}
    flush = l2_flush(device)
    gemms = {"gate_up": random_mxfp4(e, 2 * i, h, device, seed=3),
             "down": random_mxfp4(e, h, i, device, seed=4)}
    print(f"## Timing: {e} experts, H {h}, I {i}; copy bandwidth {copy_bw / 1e12:.2f} TB/s\n")
    print("| GEMM | tokens/expert | N | kernel | median us | weight TB/s | of copy BW "
          "| TFLOP/s | speedup vs bf16 |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for name, w in gemms.items():
        _, m, k = w.shape
        w_bf16 = to_bf16(w)  # [E, M, K]
        bytes_mxfp4, bytes_bf16 = w.nbytes(), w_bf16.numel() * 2
        for t in [*args.decode, *args.prefill]:
            counts, n = [t] * e, t * e
            offsets = offsets_of(counts, device)
            x_bf16 = torch.randn(n, k, dtype=torch.bfloat16, device=device)
            xq = quantize(x_bf16)
            flops = 2 * n * m * k
            bf16_runs = bf16_grouped_mm(x_bf16, w_bf16, counts, offsets)
            runs = [(f"bf16 {name}", fn, bytes_bf16) for name, fn in bf16_runs]
            route = None  # W4A4 decoded to bf16, then that GEMM (route "bf16_grouped_mm")
            if bf16_runs[0][0] == "torch._grouped_mm":
                ends = offsets[1:].to(torch.int32)
                route = partial(_dequant_grouped_mm, xq, w, ends)
                runs.append(("w4a4: bf16 dequant + torch._grouped_mm", route, bytes_mxfp4))
            for variant in variants:  # max_rows: the expert service knows its counts
                runs.append((f"triton {variant}", partial(
                    grouped_mxfp4_gemm, xq, offsets, weights_for(w, variant, layouts),
                    max_rows=t, **variant_options(variant)), bytes_mxfp4))
            config = pick(tuned, t) if tuned else None  # what the expert service runs here
            if config is not None and config.route == "triton":
                runs.append((f"tuned: {config_label(config)}", partial(
                    grouped_mxfp4_gemm, xq, offsets, weights_for(w, config.inner, layouts),
                    max_rows=t, **config.gemm_options()), bytes_mxfp4))
            elif config is not None and route is not None:
                runs.append((f"tuned: {config.route}", route, bytes_mxfp4))
            base_ms = None
            for label, fn, nbytes in runs:
                ms = time_ms(fn, args.warmup, args.iters, flush)
                base_ms = base_ms or ms
                tbs = nbytes / (ms * 1e-3) / 1e12
                print(f"| {name} | {t} | {n} | {label} | {ms * 1e3:.1f} | {tbs:.2f} | "
                      f"{tbs * 1e12 / copy_bw:.0%} | {flops / (ms * 1e-3) / 1e12:.1f} | "
                      f"{base_ms / ms:.2f}x |", flush=True)
            del x_bf16, xq
        del w_bf16
        layouts.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
    print()


def sweep_configs(variant: str, tokens: int) -> list[tuple[int, int, int, int, int, int]]:
    """(block_n, block_m, block_k, warps, stages, split_k) to try: around the best of the
    H200 runs of 2026-11-30 (docs/benchmarks.md), with K split over 4 programs at decode,
    and for "f16x2" and "bf16x2" (not yet run on a GPU) the tiles with the fewest issue
    slots per weight (benchmarks/kernel_sass.py). 36 configs per decode shape for the 8
    swept variants, as many as run 3 timed (its sweep section took 91 s of gpu_check's
    200 s limit)."""
    inner = variant.partition("/")[0]
    if tokens >= 256:
        return [(bn, 128, 32 if inner.startswith("f16") else 128, 4, 3, 1) for bn in (64, 128)]
    if inner == "f16":  # swept in run 3: block_m 256 won
        return [(16, 256, 32, 4, ns, sk) for ns in (3, 5) for sk in (1, 4)]
    if inner == "f16x2":  # block_m 512 with 8 warps: the fewest slots without spills
        return [(16, 128, 32, 4, 3, 1), (16, 256, 32, 4, 3, 1), (16, 256, 64, 4, 3, 1),
                (16, 512, 32, 8, 3, 1), (16, 256, 32, 4, 5, 4)]
    if inner == "bf16x2" and variant.endswith("/swap"):  # the fewest issue slots per weight
        # (benchmarks/kernel_sass.py): block_m 256, then 128; weights as the left operand
        return [(16, 256, 64, 4, 4, 1), (16, 256, 64, 4, 4, 4), (16, 256, 128, 4, 3, 1),
                (16, 256, 64, 4, 3, 1), (16, 128, 128, 4, 3, 1), (16, 128, 128, 4, 4, 4),
                (16, 128, 256, 4, 3, 1), (16, 512, 128, 8, 3, 1)]
    if inner == "bf16x2":  # weights as the right operand go through shared memory
        return [(16, 128, 128, 4, 3, 1), (16, 128, 64, 4, 4, 4)]
    return [(16, 128, bk, 4, 3, sk) for bk in (128, 256) for sk in (1, 4)]


def tiles(config: tuple[int, ...]) -> dict[str, int]:
    """`grouped_mxfp4_gemm` keywords of a sweep config (block_n, block_m, block_k, warps,
    stages, split_k)."""
    return dict(zip(("block_n", "block_m", "block_k", "num_warps", "num_stages", "split_k"),
                    config, strict=True))


def sweep(variants: list[str], copy_bw: float, json_path: str | None = None,
          experts: int = 32, hidden: int = 7168, inter: int = 2048,
          tokens: tuple[int, ...] = (1, 16, 512), device: str = "cuda",
          results: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Time `sweep_configs` of the `SWEPT` variants among `variants`, and the bf16 route
    (`ROUTE`), at each GEMM and tokens per expert (every call with `max_rows`, as from the
    expert service), printing a table and writing every timing to `json_path`; returns
    every timing, also appended to `results` as they come (the caller keeps them if the
    sweep is stopped). A config is timed only once its output matches the torch path's
    (relative error 1e-5, as `check`): the check ran each variant at its default tiles
    only, and a tuned table must never pick a fast wrong config."""
    from moe_kernels.grouped_gemm import mxfp4_linear
    from moe_kernels.mxfp4 import quantize
    from moe_kernels.triton_mxfp4 import grouped_mxfp4_gemm

    route = ROUTE in variants  # checked (`check`): swept beside the Triton variants
    variants = [v for v in variants if v.partition("/")[0] in SWEPT]
    flush = l2_flush(device)
    gemms = {"gate_up": random_mxfp4(experts, 2 * inter, hidden, device, seed=3),
             "down": random_mxfp4(experts, hidden, inter, device, seed=4)}
    results = [] if results is None else results
    layouts: dict[int, tuple] = {}
    print(f"## W4A4 kernel sweep (copy bandwidth {copy_bw / 1e12:.2f} TB/s)\n")
    print("| GEMM | tokens/expert | variant | block_n, block_m, block_k, warps, stages, "
          "split_k | us | weight TB/s | of copy BW | TFLOP/s |\n"
          "|---|---:|---|---|---:|---:|---:|---:|")
    for t in tokens:
        for name, w in gemms.items():
            _, m, k = w.shape
            n = t * experts
            offsets = offsets_of([t] * experts, device)
            xq = quantize(torch.randn(n, k, dtype=torch.bfloat16, device=device))
            ref = torch.cat([mxfp4_linear(xq[e * t:(e + 1) * t], w[e])  # [N, M]
                             for e in range(experts)])
            shape: list[dict[str, Any]] = []
            candidates = [(variant, config, partial(
                grouped_mxfp4_gemm, xq, offsets, weights_for(w, variant, layouts), max_rows=t,
                **tiles(config), **variant_options(variant))) for variant in variants
                for config in sweep_configs(variant, t)]
            if route:  # the other route: both operands to bf16, then torch._grouped_mm
                candidates.append((ROUTE, (), partial(_dequant_grouped_mm, xq, w,
                                                      offsets[1:].to(torch.int32))))
            for variant, config, fn in candidates:
                try:  # (the route's bf16-rounded outputs: checked by `check`, to its bound)
                    err = 0.0 if variant == ROUTE else rel_err(fn(), ref)
                    ms = time_ms(fn, 2, 7, flush) if err <= 1e-5 else None
                except Exception as exc:  # e.g. out of shared memory for this tile
                    print(f"| {name} | {t} | {variant} | {config} | "
                          f"{type(exc).__name__} | | | |")
                    continue
                if ms is None:
                    print(f"| {name} | {t} | {variant} | {config} | WRONG: max rel err "
                          f"{err:.2e} vs the torch path | | | |", flush=True)
                    continue
                tbs = w.nbytes() / (ms * 1e-3)
                shape.append({"gemm": name, "tokens_per_expert": t, "variant": variant,
                              "config": list(config), "us": ms * 1e3,
                              "weight_tb_s": tbs / 1e12, "of_copy_bw": tbs / copy_bw})
                print(f"| {name} | {t} | {variant} | {config} | {ms * 1e3:.1f} | "
                      f"{tbs / 1e12:.2f} | {tbs / copy_bw:.0%} | "
                      f"{2 * n * m * k / (ms * 1e-3) / 1e12:.1f} |", flush=True)
            results.extend(shape)
            del ref
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(results, f, indent=1)
    return results


def best_per_shape(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`sweep`'s fastest timing per (GEMM, tokens per expert), with how many were tried and
    each variant's best time there."""
    shapes: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        shapes.setdefault((r["gemm"], r["tokens_per_expert"]), []).append(r)
    best = []
    for shape in shapes.values():
        per_variant: dict[str, float] = {}
        for r in shape:
            per_variant[r["variant"]] = min(r["us"], per_variant.get(r["variant"], r["us"]))
        best.append({**min(shape, key=lambda r: r["us"]), "tried": len(shape),
                     "per_variant": per_variant})
    return best


def best_configs(results: list[dict[str, Any]]) -> dict[int, KernelConfig]:
    """Per tokens per expert, the variant and tiles whose times summed over the GEMMs are
    least (one config serves both GEMMs of an expert FFN), among those timed for every
    GEMM: the table `moe_kernels.kernel_configs` serves. Configs of earlier sweeps without
    split_k ran with 1."""
    from moe_kernels.kernel_configs import KernelConfig

    gemms = {r["gemm"] for r in results}
    totals: dict[tuple[int, str, tuple[int, ...]], dict[str, float]] = {}
    for r in results:
        key = (r["tokens_per_expert"], r["variant"], tuple(r["config"]))
        totals.setdefault(key, {})[r["gemm"]] = r["us"]
    best: dict[int, tuple[float, str, tuple[int, ...]]] = {}
    for (tokens, variant, config), us in sorted(totals.items()):
        total = sum(us.values())
        if set(us) == gemms and (tokens not in best or total < best[tokens][0]):
            best[tokens] = (total, variant, config)
    configs = {}
    for tokens, (_, variant, config) in best.items():
        if variant == ROUTE:
            configs[tokens] = KernelConfig(route=ROUTE)
            continue
        bn, bm, bk, warps, stages, *split = config
        configs[tokens] = KernelConfig(**variant_options(variant), block_n=bn, block_m=bm,
                                       block_k=bk, num_warps=warps, num_stages=stages,
                                       split_k=split[0] if split else 1)
    return configs


def write_tuned(results: list[dict[str, Any]], path: str | None, source: str) -> str:
    """Write `best_configs(results)` for this GPU to `path` (default: the bundled
    `moe_kernels/configs/<device>.json`); returns the path written."""
    from pathlib import Path

    from moe_kernels.kernel_configs import config_path, write_configs

    device = torch.cuda.get_device_name()
    target = Path(path) if path else config_path(device)
    write_configs(target, device, source, best_configs(results))
    return str(target)


def main() -> int:
    args = parse_args()
    if args.write_config is not None and args.sweep is None:
        print("gpu_mxfp4: --write-config needs --sweep", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_mxfp4: no CUDA device found; this benchmark needs an NVIDIA GPU "
              "(H100/H200). Nothing to do.")
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("gpu_mxfp4: unsetting TRITON_INTERPRET to compile for the GPU", file=sys.stderr)
        os.environ["TRITON_INTERPRET"] = "0"
    try:
        import triton
    except ImportError:
        print("gpu_mxfp4: triton is not installed (pip install triton>=3.8)", file=sys.stderr)
        return 2
    print(f"# W4A4 MXFP4 grouped GEMM: {torch.cuda.get_device_name()}, torch "
          f"{torch.__version__}, triton {triton.__version__}\n")
    torch.manual_seed(0)
    ok, variants = (True, list(args.variants)) if args.skip_check else check(args,
                                                                            args.variants)
    copy_bw = copy_bandwidth(args.copy_gib)
    if variants:
        bench(args, variants, copy_bw)
        if args.sweep is not None:
            results = sweep(variants, copy_bw, args.sweep or None, args.experts, args.hidden,
                            args.inter)
            if args.write_config is not None and (not ok or args.skip_check):
                print("not writing tuned configs: the check failed or was skipped",
                      file=sys.stderr)
            elif args.write_config is not None and results:
                path = write_tuned(results, args.write_config or None, (
                    f"{time.strftime('%Y-%m-%d')}, triton {triton.__version__}, "
                    f"{args.experts} experts, H {args.hidden}, I {args.inter}: python -m "
                    f"benchmarks.gpu_mxfp4 {' '.join(sys.argv[1:])}"))
                print(f"tuned configs written to {path}")
    else:
        print("no Triton variant ran; nothing to time")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
