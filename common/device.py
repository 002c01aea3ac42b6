"""Where a service computes (`--device`), and the collective backend that goes with it.

torch is imported only where a CUDA device is asked about or a dtype made: `switchyard
serve` checks its flags with this module and never computes."""

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
