"""What `switchyard serve` and the services refuse before they open a port: a device this
machine lacks, a bad checkpoint, generation defaults no request could ask for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst



NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")




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
    one, collecting tests/moe_kernels/test_triton_mxfp4.py set TRITON_INTERPRET=1, and Triton would
    interpret the kernels instead of compiling them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_mxfp4", "--hidden", "512",
                          "--inter", "256", "--variants", "dot_scaled", "decode", "--decode", "1",
                          "--prefill", "--warmup", "1", "--iters", "2", "--copy-gib", "0.25"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no Triton variant ran" not in out.stdout, out.stdout


@NO_GPU
def test_serve_refuses_nccl_on_the_cpu() -> None:
    out = subprocess.run([sys.executable, "-m", "switchyard", "serve", "--dispatch-backend",
                          "nccl"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "moves CUDA tensors" in out.stderr


def test_serve_reports_a_bad_checkpoint_without_opening_ports(qwen3_ckpt: tuple,
                                                              tmp_path: Path) -> None:
    d = copy(qwen3_ckpt[0], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.norm.weight"] = torch.zeros(7)
    save_file(tensors, d / "model.safetensors")
    proc = subprocess.run([sys.executable, "-m", "switchyard", "serve", "--model", str(d),
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "'model.norm.weight' has shape [7]" in proc.stderr
    assert "exited with status" in proc.stderr and "Switchyard is serving" not in proc.stdout


def test_serve_names_the_config_field_it_cannot_serve(deepseek_v3_ckpt: tuple,
                                                      tmp_path: Path) -> None:
    d = copy(deepseek_v3_ckpt[0], tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"topk_method": "greedy"}))
    proc = subprocess.run([sys.executable, "-m", "switchyard", "serve", "--model", str(d),
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "field 'topk_method' 'greedy' is not supported for DeepseekV3ForCausalLM" \
        in proc.stderr
    assert "Switchyard is serving" not in proc.stdout


@pytest.mark.parametrize(("generation", "error"), [
    ({"temperature": -1}, "temperature -1.0 is out of range"),
    ({"max_new_tokens": 0}, "max_new_tokens 0 is out of range"),
    ({"top_p": float("inf")}, "top_p inf is out of range"),
    ({"max_new_tokens": 1e999}, "cannot convert float infinity to integer"),
    ({"top_k": "20"}, "top_k must be an integer")])
def test_serve_refuses_generation_defaults_no_request_could_ask_for(
        qwen3_ckpt: tuple, tmp_path: Path, generation: dict, error: str) -> None:
    """Before any service starts: a default out of range would fail every request that
    leaves the field out."""
    d = copy(qwen3_ckpt[0], tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps(generation))
    proc = subprocess.run([sys.executable, "-m", "switchyard", "serve", "--model", str(d),
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"switchyard serve: --generation-config: {d}/generation_config.json: {error}" \
        in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("flags", "error"), [
    (["--dispatch-backend", "torch"], "the torch dispatch backend cannot"),
    (["--expert-services", "3", "--num-redundant-experts", "2"],
     "8 experts + 2 copies do not spread evenly over 3 expert services"),
    (["--num-redundant-experts", "-1"], "--num-redundant-experts must not be negative"),
    (["--eplb-window", "0"], "--eplb-window, --eplb-num-groups and --eplb-num-nodes must "
                             "be positive")])
def test_serve_refuses_eplb_it_cannot_run(qwen3_ckpt: tuple, flags: list[str],
                                          error: str) -> None:
    """Before any service starts: expert load balancing needs movable (rpc) expert
    services and EPLB's copies spread evenly over them."""
    proc = subprocess.run([sys.executable, "-m", "switchyard", "serve", "--model",
                           str(qwen3_ckpt[0]), "--port", "0", "--enable-eplb", *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert error in proc.stderr and "Traceback" not in proc.stderr
