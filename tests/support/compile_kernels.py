"""Compile the Triton kernels for NVIDIA GPUs without one:
`python -m tests.support.compile_kernels`.

The interpreter runs the kernels' Python, which is not what the compiler sees (a constexpr
branch that returns is still traced after it, for one), so CPU CI also compiles each variant
to PTX and a cubin for Hopper (sm_90), the default and bf16x2 for Blackwell (sm_100),
bf16x2 for Ampere (sm_80), and the MXFP4 decode and quantize kernels. Run without
TRITON_INTERPRET. Prints one line per variant; exits 1 if any fails to compile.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_kernels: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from benchmarks.kernel_sass import compile_gemm
from moe_kernels import triton_mxfp4
from moe_kernels.kernel_configs import INNER_PRODUCTS


def compile_dequantize(arch: int) -> None:
    """`_dequantize_kernel` to bfloat16 (the bf16-GEMM route's decode), for sm_{arch}."""
    fn = triton_mxfp4._dequantize_kernel
    constants = {"BLOCK_R": 16, "BLOCK_K": 128}
    types = {"packed_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*bf16"}
    signature = {name: "constexpr" if name in constants else types.get(name, "i32")
                 for name in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", arch, 32),
                   options={"num_warps": 4})


def compile_quantize(arch: int, dtype: str) -> None:
    """`_quantize_kernel` from `dtype` rows (what CUDA services quantize), for sm_{arch}."""
    fn = triton_mxfp4._quantize_kernel
    constants = {"BLOCK_R": 16, "BLOCK_K": 128}
    types = {"x_ptr": f"*{dtype}", "packed_ptr": "*u8", "scales_ptr": "*u8"}
    signature = {name: "constexpr" if name in constants else types.get(name, "i32")
                 for name in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", arch, 32),
                   options={"num_warps": 4})


def variants() -> list[tuple[int, str, bool, int, int, int, bool, int, int]]:
    """(arch, inner, swap_ab, block_n, block_m, block_k, even_k, split_k, num_stages): every
    inner product and operand order at decode tiles (the tuned H200 ones among them), a
    partial last K step, K split, the prefill tiles, and "bf16x2" (inline PTX) for both
    architectures."""
    out = []
    for inner in INNER_PRODUCTS:
        f16 = inner.startswith("f16")
        for swap in (False, True):
            out.append((90, inner, swap, 16, 256 if f16 else 128, 32 if f16 else 128, True, 1,
                        5 if f16 else 3))
        out.append((90, inner, False, 16, 128, 64 if f16 else 128, False, 2, 3))
    out.append((90, "dot_scaled", False, 64, 128, 128, True, 1, 3))
    out.append((100, "dot_scaled", False, 16, 128, 128, True, 1, 3))
    out.append((100, "dot_scaled", True, 64, 128, 128, True, 1, 3))
    out.append((90, "bf16x2", True, 16, 256, 64, True, 1, 4))  # the fewest slots, no spills
    out.append((100, "bf16x2", True, 16, 128, 128, True, 1, 3))  # its inline PTX on Blackwell
    out.append((80, "bf16x2", True, 16, 128, 64, True, 1, 3))  # and on Ampere
    return out


def main() -> int:
    failed = 0
    jobs = [(variant, lambda v=variant: compile_gemm(*v)) for variant in variants()]
    jobs.append(((90, "dequantize"), lambda: compile_dequantize(90)))
    jobs += [((90, "quantize", t), lambda t=t: compile_quantize(90, t))
             for t in ("fp32", "bf16", "fp16")]
    for variant, job in jobs:
        start = time.perf_counter()
        try:
            job()
            result = "ok"
        except Exception:  # a compile error: report it whole, go on with the others
            failed += 1
            result = "FAILED\n" + traceback.format_exc(limit=3)
        print(f"sm_{variant[0]} {variant[1:]}: {result} ({time.perf_counter() - start:.1f} s)",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
