"""Where a service computes (`--device`), and the collective backend that goes with it."""

from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda")


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
