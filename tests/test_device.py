"""`--device`: the GPU code imports on a CPU machine, GPU-only checks skip with a reason,
and asking for a device this process cannot use is a clear start-up error."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

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


@NO_GPU
@pytest.mark.parametrize("command", [["serve"], ["attention", "--port", "0"],
                                     ["expert", "--rank", "0", "--num-ranks", "1"]])
def test_services_refuse_cuda_without_a_gpu(command: list[str]) -> None:
    from switchyard.demo_model import DEFAULT_MODEL

    out = subprocess.run([sys.executable, "-m", "switchyard", *command, "--model",
                          str(DEFAULT_MODEL), "--device", "cuda"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--device cuda needs an NVIDIA GPU" in out.stderr


@NO_GPU
def test_the_gpu_check_says_there_is_nothing_to_do_without_a_gpu() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "no CUDA device" in out.stdout


@pytest.mark.gpu
def test_w4a4_triton_kernel_matches_the_torch_path_on_the_gpu() -> None:
    """The grouped MXFP4 GEMM compiled for this GPU against the torch path, uneven and
    empty experts included (benchmarks/gpu_mxfp4.py's check). In its own process: in this
    one, collecting tests/test_triton_mxfp4.py set TRITON_INTERPRET=1, and Triton would
    interpret the kernels instead of compiling them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_mxfp4", "--hidden", "512",
                          "--inter", "256", "--variants", "dot_scaled", "decode", "--decode", "1",
                          "--prefill", "--warmup", "1", "--iters", "2", "--copy-gib", "0.25"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no Triton variant ran" not in out.stdout, out.stdout


def test_nccl_backend_needs_cuda_and_names_cupy() -> None:
    from ep_dispatch.registry import MoESeam, backend, create_experts_client

    with pytest.raises(ValueError, match="moves CUDA tensors: run the services with "
                                         "--device cuda"):
        backend("nccl", "cpu")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs CuPy with NCCL: pip install cupy-cuda12x"):
            create_experts_client("nccl", MoESeam([0], 8, device="cuda"))


@NO_GPU
def test_serve_refuses_nccl_on_the_cpu() -> None:
    out = subprocess.run([sys.executable, "-m", "switchyard", "serve", "--dispatch-backend",
                          "nccl"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "moves CUDA tensors" in out.stderr


def test_nccl_all_to_all_plan() -> None:
    """Byte offsets of the grouped sends and receives, as all_to_all_single's splits."""
    from ep_dispatch.nccl import p2p_plan

    # 3 ranks, 8-byte rows: send 2 rows to rank 0, none to 1, 1 to 2; receive 0, 3, 1.
    assert p2p_plan([0, 3, 1], [2, 0, 1], 8) == [
        (0, 0, 16, 0, 0), (1, 16, 0, 0, 24), (2, 16, 8, 24, 8)]
    assert p2p_plan([0, 0], [0, 0], 8) == []


@pytest.mark.parametrize("uid", [bytes(range(128)),  # CuPy 14: bytes
                                 tuple(range(-64, 64))])  # CuPy 13: signed chars
def test_nccl_unique_id_crosses_the_store_in_the_type_cupy_gave(uid: bytes | tuple) -> None:
    import datetime

    import torch.distributed as dist

    from ep_dispatch.nccl import decode_unique_id, encode_unique_id

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    store.set("uid", encode_unique_id(uid))
    back = decode_unique_id(store.get("uid"))
    assert back == uid and type(back) is type(uid)


def test_the_nccl_backend_reports_its_metrics_as_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """It reuses the torch backend's exchange: its dispatch and combine histograms must
    still say `backend="nccl"` (the docs and dashboard name it so)."""
    from ep_dispatch import nccl
    from ep_dispatch.registry import (
        BackendSettings,
        MoESeam,
        WorldSettings,
        create_experts_client,
    )
    from ep_dispatch.torch_dist import World

    monkeypatch.setattr(nccl, "import_nccl", lambda: None)
    monkeypatch.setattr(nccl, "CupyNccl", lambda *args: "communicator")
    world = World(("127.0.0.1", 1), 1, 1, rank=0)
    client = create_experts_client("nccl", MoESeam([0], 8, device="cuda"),
                                   BackendSettings(world=WorldSettings(world)))
    assert (client.backend, client.coll) == ("nccl", "communicator")  # type: ignore[attr-defined]
