"""Which kernel runs where: the top of `moe_kernels`, the one module that picks between the
torch versions (any device) and the Triton ones (CUDA), so that the formats below never
import the kernels built on them."""

from __future__ import annotations

import torch

from moe_kernels.mxfp4 import MXFP4Tensor, quantize


def quantize_fused(x: torch.Tensor) -> MXFP4Tensor:
    """`quantize(x)`, on CUDA in one Triton kernel (`triton_mxfp4.quantize_mxfp4`, bit for
    bit the same under the tests' interpreter; the torch version runs 58 tensor
    operations per call, counted with a TorchDispatchMode on [32, 7168] bfloat16 rows)."""
    if x.device.type != "cuda":
        return quantize(x)
    from moe_kernels.triton_mxfp4 import quantize_mxfp4

    return quantize_mxfp4(x)
