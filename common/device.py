"""Where a service computes (`--device`), and the collective backend that goes with it.

torch is imported only where a CUDA device is asked about or a dtype made: `switchyard
serve` checks its flags with this module and never computes.

`--device cpu|cuda` belongs to an attention or expert service. On either device the
checkpoint is read on the host, and each tensor is moved to the device once. Step batches
are built on the host and copied once per step (`StepBatch.to`). Sampling uses per-request
generators on the device. Dispatch layouts are planned on the device, where the placement
tables are copied once, with one copy of the row counts to the host. `rpc` copies rows to
the host once for the wire. The `torch` backend and DCP use NCCL for CUDA tensors and gloo
for CPU ones.
Routing counts accumulate on the device and are copied to the host once per step, so
`/stats` never waits on the GPU. `switchyard serve --device cuda` pins each service to a GPU
(`CUDA_VISIBLE_DEVICES`, round-robin) and refuses layouts where NCCL ranks would share one.

On CUDA, an `ExpertBank` runs W4A4 through the Triton kernel. The kernel uses
`tl.dot_scaled`, or the in-kernel decode where this Triton cannot compile that for the GPU,
which is probed once. The expert service passes its host-side counts, so the kernel's grid
needs no device-built tile schedule. Float experts run as two `torch._grouped_mm` calls
where that runs and agrees with the per-expert loop on the first batch, checked once;
otherwise they run expert by expert. Per-expert times come from CUDA events with one
synchronisation per layer call; experts that run together share the call's time. Attention
is torch's SDPA without cuDNN's backend, which plans each new shape, while decode shapes
change every step. With grouped KV heads, each KV head's query heads are folded into its
query rows, so the mem-efficient kernel takes the mask with no K/V copies. A DCP shard,
which needs the log-sum-exp, still uses the plain-torch partial attention.

On an H200 the CUDA path's logits matched the CPU's (float32: 2e-5 relative), serving over
`rpc` answered as on the CPU, and the `torch` and `nccl` collectives ran at world size 1.
That run was at 01fcb25 (`benchmarks/gpu_check.py`, docs/benchmarks.md), before the grouped
GEMMs of float experts and the query-head folding, which have not run on a GPU. Across GPUs
the collectives are untested, as one GPU was lent.

Numerics: `--dtype auto` is float32 on the CPU, because torch's bf16 matmul is about 100x
slower than float32 without AVX-512 BF16, and bfloat16 on a GPU. RMSNorm and the router
softmax run in float32, as transformers does. In float32 the logits equal transformers'
within 1e-4; about 1e-6 was measured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")  # torch's names


def check_device(name: str, service: str) -> str:
    """`name` if this process can compute there; otherwise an error saying why not."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose {' or '.join(DEVICES)}")
    if name != "cuda":
        return name
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device cuda needs an NVIDIA GPU and a CUDA build of torch; "
                         f"this torch ({torch.__version__}) sees no GPU (the {service} "
                         "service can run with --device cpu)")
    return name


def collective_backend(device: str) -> str:
    """torch.distributed's backend for tensors on `device`: NCCL for CUDA, else gloo."""
    return "nccl" if device == "cuda" else "gloo"


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """'auto' is float32 on CPU: without AVX-512 BF16, torch's bf16 matmul is ~100x slower."""
    import torch

    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return getattr(torch, name)
