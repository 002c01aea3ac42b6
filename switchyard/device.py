"""Where a service computes (`--device`), and the collective backend that goes with it."""

from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(name: str, service: str) -> str:
    """`name` if this process can compute there; otherwise an error saying why not."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; choose {' or '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda needs an NVIDIA GPU and a CUDA build of torch; "
                         f"this torch ({torch.__version__}) sees no GPU (the {service} "
                         "service can run with --device cpu)")
    return name


def collective_backend(device: str) -> str:
    """torch.distributed's backend for tensors on `device`: NCCL for CUDA, else gloo."""
    return "nccl" if device == "cuda" else "gloo"


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """'auto' is float32 on CPU: without AVX-512 BF16, torch's bf16 matmul is ~100x slower."""
    if name == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]
