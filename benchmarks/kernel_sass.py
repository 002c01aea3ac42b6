"""env -u TRITON_INTERPRET .venv/bin/python -m benchmarks.kernel_sass [--arch 90]

What the W4A4 kernel's main loop compiles to, per variant, without a GPU.

Compiles `moe_kernels.triton_mxfp4._grouped_mxfp4_gemm_kernel` for sm_{arch} at decode tiles
(Triton's own ptxas; nvdisasm from the Triton wheel), finds the K loop (the longest
backward branch in the SASS), and counts its instructions: per thread per iteration, and as
issue slots per weight element (instructions x threads / weight elements per iteration).
At decode the kernel is bound by turning codes into MMA operands, not by memory
(docs/benchmarks.md), so this count is the budget a variant spends per weight: a static
figure, not a speed (latency, stalls and occupancy are for a GPU run to show).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("kernel_sass: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_kernels import triton_mxfp4
from moe_kernels.kernel_configs import INNER_PRODUCTS

POINTERS = {"x_ptr": "*u8", "x_scale_ptr": "*u8", "w_ptr": "*u8", "w_scale_ptr": "*u8",
            "out_ptr": "*fp32", "offsets_ptr": "*i32", "tile_expert_ptr": "*i32",
            "tile_row_ptr": "*i32"}
# What the launcher specialises when K is a multiple of 32 (dense rows, 16-byte aligned).
DIVISIBLE = ("x_ptr", "x_scale_ptr", "w_ptr", "w_scale_ptr", "out_ptr", "offsets_ptr",
             "tile_expert_ptr", "tile_row_ptr", "M", "K", "stride_xn", "stride_we",
             "stride_wm", "stride_on")
# (inner, swap_ab, block_n, block_m, block_k, num_stages, warps): the defaults, the H200's
# tuned decode config (f16/swap), and the f16x2 and bf16x2 candidates
DECODE = [("dot_scaled", False, 16, 128, 128, 3, 4), ("dot_scaled", True, 16, 128, 128, 3, 4),
          ("decode", True, 16, 128, 128, 3, 4), ("bf16", True, 16, 128, 128, 3, 4),
          ("f16", True, 16, 256, 32, 5, 4), ("f16", True, 16, 256, 128, 3, 4),
          ("f16x2", True, 16, 256, 32, 5, 4), ("f16x2", True, 16, 256, 128, 3, 4),
          ("f16x2", True, 16, 512, 32, 3, 4), ("f16x2", True, 16, 512, 32, 3, 8),
          ("bf16x2", False, 16, 128, 128, 3, 4), ("bf16x2", True, 16, 128, 128, 3, 4),
          ("bf16x2", True, 16, 256, 64, 4, 4), ("bf16x2", True, 16, 256, 128, 3, 4)]
# prefill tiles (64 and 128 tokens per tile): where the MMA, not the decode, should bound
PREFILL = [("dot_scaled", False, 64, 128, 128, 3, 4), ("dot_scaled", False, 128, 128, 128, 3, 4),
           ("bf16x2", False, 64, 128, 128, 3, 4), ("bf16x2", True, 64, 128, 128, 3, 4),
           ("bf16x2", False, 128, 128, 128, 3, 4), ("bf16x2", True, 128, 128, 128, 3, 4)]


def compile_gemm(arch: int, inner: str, swap_ab: bool, block_n: int, block_m: int,
                 block_k: int, even_k: bool = True, split_k: int = 1, num_stages: int = 3,
                 num_warps: int = 4) -> triton.compiler.CompiledKernel:
    """`_grouped_mxfp4_gemm_kernel` on the dense grid, compiled to a cubin for sm_{arch}."""
    fn = triton_mxfp4._grouped_mxfp4_gemm_kernel
    constants = {"BLOCK_N": block_n, "BLOCK_M": block_m, "BLOCK_K": block_k,
                 "INNER": INNER_PRODUCTS[inner], "SWAP_AB": swap_ab, "DENSE": True,
                 "EVEN_K": even_k, "SPLIT_K": split_k}
    pointers = {**POINTERS, "x_ptr": "*bf16", "x_scale_ptr": "*bf16"} if inner == "bf16x2" \
        else POINTERS  # "bf16x2" reads the activations' values, decoded ahead
    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32")
                 for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in DIVISIBLE}
    return triton.compile(ASTSource(fn, signature, constants, attrs),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _cubin_tool(kernel: triton.compiler.CompiledKernel, tool: str, *flags: str) -> str:
    """Run one of the Triton wheel's CUDA binary tools on the kernel's cubin."""
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([path, *flags, f.name], capture_output=True, text=True,
                              check=True).stdout


def sass(kernel: triton.compiler.CompiledKernel) -> str:
    return _cubin_tool(kernel, "nvdisasm", "-c")


def registers(kernel: triton.compiler.CompiledKernel) -> tuple[int, int]:
    """(registers per thread, stack bytes: spills when > 0)."""
    usage = _cubin_tool(kernel, "cuobjdump", "-res-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def main_loop(text: str) -> list[str]:
    """The instructions of the longest loop: from a label to a branch back to it."""
    instructions: list[str] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
        elif found := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line):
            instructions.append(found.group(1).strip())
    best: list[str] = []
    for i, ins in enumerate(instructions):
        back = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", ins)
        if back and labels.get(back.group(1), i + 1) <= i:
            body = instructions[labels[back.group(1)]:i + 1]
            best = body if len(body) > len(best) else best
    return best


# Integer logic, shift, permute, compare and add: the ALU pipe, which NVIDIA's throughput
# table gives half the issue rate on sm_80/sm_90 (64 results per clock per SM, where FP32
# and IMAD-class work has 128): a loop of these could be bound by that pipe before the
# issue slots. The set is approximate (one reading of the table), so it is reported apart.
ALU = {"LOP3", "SHF", "PRMT", "ISETP", "IADD3", "SEL", "FSEL", "LEA", "VIADD", "IMNMX",
       "PLOP3", "SGXT", "BMSK"}


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90, 100")
    args = ap.parse_args()
    print(f"W4A4 kernel main loop, sm_{args.arch}, triton {triton.__version__}\n")
    print("| variant | block_n, block_m, block_k, stages, warps | instructions per iteration "
          "| issue slots per weight | of them integer ALU | registers, spill bytes | most "
          "frequent |\n|---|---|---:|---:|---:|---|---|")
    for inner, swap, bn, bm, bk, stages, warps in DECODE + PREFILL:
        kernel = compile_gemm(args.arch, inner, swap, bn, bm, bk, num_stages=stages,
                              num_warps=warps)
        body = main_loop(sass(kernel))
        ops = collections.Counter(map(opcode, body))
        slots = len(body) * warps * 32 / (bm * bk)
        alu = sum(n for op, n in ops.items() if op in ALU) * warps * 32 / (bm * bk)
        regs, stack = registers(kernel)
        print(f"| {inner}{'/swap' if swap else ''} | {bn}, {bm}, {bk}, {stages}, {warps} | "
              f"{len(body)} | {slots:.2f} | {alu:.2f} | {regs}, {stack} | "
              f"{', '.join(f'{k} {v}' for k, v in ops.most_common(6))} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
