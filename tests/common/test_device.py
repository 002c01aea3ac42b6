"""`--device`: the GPU code imports on a CPU machine, and asking for a device this process
cannot use is a clear error (the services' refusals: tests/e2e/test_serve_refusals.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from common.device import check_device, collective_backend

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@pytest.mark.parametrize("module", ["moe_kernels.triton_mxfp4", "benchmarks.gpu_mxfp4",
                                    "benchmarks.gpu_check",
                                    "ep_dispatch.torch_dist", "common.device"])
def test_gpu_code_imports_without_cuda(module: str) -> None:
    importlib.import_module(module)


def test_devices_and_their_collectives() -> None:
    assert check_device("cpu", "attention") == "cpu"
    assert collective_backend("cpu") == "gloo" and collective_backend("cuda") == "nccl"
    with pytest.raises(ValueError, match="unknown device 'tpu'; choose cpu or cuda"):
        check_device("tpu", "attention")


@NO_GPU
def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"--device cuda needs an NVIDIA GPU and a CUDA build "
                                         r"of torch; this torch .* sees no GPU"):
        check_device("cuda", "expert")
















