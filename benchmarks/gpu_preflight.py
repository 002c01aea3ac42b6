"""python -m benchmarks.gpu_preflight [KERNEL ...]     (default: all of `KERNELS`)

Each Triton kernel of the W4A4 path run once, small, then synchronised: what
`benchmarks.gpu_check` runs in a child process before anything else. A kernel that faults
the GPU (an illegal instruction, a misaligned or illegal address) leaves the CUDA context
of its process unusable, so in the check's own process it would fail every later section
of a run that gets a few minutes of a GPU; here it costs one row.

Prints `start NAME` before and `ok NAME` after each kernel, flushed; on an exception
prints `error NAME: ...` and exits 1 (the context may be gone), so the kernel with a
`start` line and no `ok` line is the one that failed, however the process ended.
"""

from __future__ import annotations

import sys

import torch

from benchmarks.gpu_mxfp4 import (
    VARIANTS,
    failure,
    offsets_of,
    random_mxfp4,
    variant_options,
    weights_for,
)

QUANTIZE, DEQUANTIZE = "quantize kernel", "dequantize kernel"
KERNELS = [*VARIANTS, QUANTIZE, DEQUANTIZE]


def run(name: str, device: str = "cuda") -> None:
    """One small call of kernel `name` (a `VARIANTS` inner product, or the activations'
    quantize or dequantize kernel); uneven experts and a partial K step included."""
    from moe_kernels.mxfp4 import quantize
    from moe_kernels.triton_mxfp4 import dequantize_mxfp4, grouped_mxfp4_gemm, quantize_mxfp4

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(37, 320, device=device, generator=g)  # [N, K]: 2.5 K steps of 128
    if name == QUANTIZE:
        quantize_mxfp4(x)
        quantize_mxfp4(x.bfloat16())
    elif name == DEQUANTIZE:
        dequantize_mxfp4(quantize(x), torch.bfloat16)
    else:
        w = random_mxfp4(3, 96, 320, device, seed=1)  # [E, M, K]
        grouped_mxfp4_gemm(quantize(x), offsets_of([5, 0, 32], device),
                           weights_for(w, name, {}), **variant_options(name))


def main(names: list[str]) -> int:
    for name in names:
        print(f"start {name}", flush=True)
        try:
            run(name)
            torch.cuda.synchronize()
        except Exception as exc:
            print(f"error {name}: {failure(exc)}", flush=True)
            return 1
        print(f"ok {name}", flush=True)
    return 0


def outcome(stdout: str, returncode: int | str) -> tuple[list[str], tuple[str, str] | None]:
    """A child's output read back (returncode: its exit code, or why it ended): the kernels
    that ran, and (kernel, why) for the one that failed, if one did."""
    done, started = [], None
    why = f"the process ended with code {returncode}" if isinstance(returncode, int) \
        else f"the process was {returncode}"
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "start":
            started = rest
        elif word == "ok" and rest == started:
            done.append(rest)
            started = None
        elif word == "error":
            why = rest.partition(": ")[2]
    return done, (started, why) if started is not None else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or KERNELS))
