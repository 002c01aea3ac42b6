"""The 8-bit dense scheme (`--dense-quantization int8`) end to end: next-token
distributions near float32's on every family, the compiled blocks reading int8 panels,
a checkpoint written in int8 served as quantizing at load serves it, and the scheme's
refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.expert.quantize import main as quantize_main
from services.model.config import ModelConfig
from services.model.dense import SCALE_SUFFIX
from tests.support import checkpoints
from tests.support.engines import dcp_engine, engine_for, greedy, prompts, run_to_completion

POSITIONS = (40, 72, 144)  # 256 positions, prompts as long as the tiny models serve
# The mean KL(float32 || int8) of next-token distributions over those positions, first
# measured on 2026-12-05 (int8 weights, activations in blocks of 32): Qwen3-MoE 5.9e-4,
# Mixtral 5.2e-4, Qwen2-MoE 1.2e-4, DeepSeek-V2 1.8e-4 and 2.2e-4, DeepSeek-V3 1.1e-3 and
# 1.3e-3 (the tests print each). The bound holds the largest with 2.3x room; a scheme
# that lost a scale or a row is orders of magnitude above it.
KL_BOUND = 3e-3


def mean_kl(path: Path) -> float:
    full = engine_for(path, max_num_batched_tokens=256)
    int8 = engine_for(path, max_num_batched_tokens=256, dense_quantization="int8")
    kls = []
    for prompt in prompts(seed=9, lengths=POSITIONS):
        p = torch.log_softmax(full.score(prompt).double(), -1)  # [L, V]
        q = torch.log_softmax(int8.score(prompt).double(), -1)
        kls.append((p.exp() * (p - q)).sum(-1))
    return float(torch.cat(kls).mean())


def test_next_token_distributions_stay_near_float32(every_ckpt: tuple) -> None:
    path, _ = every_ckpt
    kl = mean_kl(path)
    print(f"{ModelConfig.from_dir(path).architecture}: mean KL {kl:.3g} over "
          f"{sum(POSITIONS)} positions")
    assert 0 < kl < KL_BOUND


@pytest.fixture(scope="module")
def w4a4_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A tiny Qwen3-MoE whose hidden (64) and expert (96) sizes MXFP4 can block."""
    path = tmp_path_factory.mktemp("qwen3-w4a4")
    return path, checkpoints.build(checkpoints.qwen3_moe_config(moe_intermediate_size=96),
                                   path, seed=3)


@pytest.mark.parametrize(("name", "experts"), [("qwen3", "none"), ("w4a4", "mxfp4"),
                                               ("deepseek_v3", "none")])
def test_a_checkpoint_stored_in_int8_serves_as_quantizing_at_load(
        name: str, experts: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """`switchyard quantize --dense int8` stores each dense linear as int8 and its scales
    (kv_b_proj, the router, embeddings and norms float); served, it gives what quantizing
    at load gives, bit for bit; served as float, it is refused."""
    path, _ = request.getfixturevalue(f"{name}_ckpt")
    out = tmp_path / "int8"
    assert quantize_main(["--model", str(path), "--out", str(out), "--experts", experts,
                          "--dense", "int8"]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "switchyard" and qc["dense"] == "int8"
    cfg = ModelConfig.from_dir(out)
    assert cfg.dense_quantization == "int8"
    assert cfg.quantization == (None if experts == "none" else "w4a4")
    from safetensors import safe_open

    with safe_open(next(out.glob("*.safetensors")), "pt") as f:
        stored = {n: f.get_slice(n).get_dtype() for n in f.keys()}  # noqa: SIM118
    linears = [n for n in stored if n.endswith(("o_proj.weight", "q_a_proj.weight",
                                                "q_proj.weight", "lm_head.weight"))]
    assert linears and all(stored[n] == "I8" and stored[n + SCALE_SUFFIX] == "F32"
                           for n in linears)
    assert all(stored[n] == "F32" for n in stored if n.endswith(
        ("kv_b_proj.weight", "embed_tokens.weight", "mlp.gate.weight", "norm.weight")))

    at_load = {"dense_quantization": "int8", "quantization": "auto" if experts == "none"
               else "w4a4"}
    reqs = {0: [greedy(f"r{i}", p, 12) for i, p in enumerate(prompts(seed=6, lengths=(5, 12)))]}
    assert run_to_completion(engine_for(out), reqs) == \
        run_to_completion(engine_for(path, **at_load), reqs)
    prompt = prompts(seed=7, lengths=(30,))[0]
    assert torch.equal(engine_for(out).score(prompt), engine_for(path, **at_load).score(prompt))
    with pytest.raises(ValueError, match="--dense-quantization int8 or auto"):
        engine_for(out, dense_quantization="none")


def test_an_unknown_scheme_and_a_mislabelled_weight_are_refused(qwen3_ckpt: tuple,
                                                                 tmp_path: Path) -> None:
    path, _ = qwen3_ckpt
    with pytest.raises(ValueError, match="unknown dense-quantization 'int4'"):
        engine_for(path, dense_quantization="int4")
    out = tmp_path / "int8"
    assert quantize_main(["--model", str(path), "--out", str(out), "--experts", "none",
                          "--dense", "int8"]) == 0
    from safetensors.torch import load_file, save_file

    shard = next(out.glob("*.safetensors"))
    tensors = load_file(shard)
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name] = tensors[name].float()  # a scale beside a float weight
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=f"{name}.*stored as torch.float32, not int8"):
        engine_for(out)


def test_a_dcp_group_reads_its_dense_linears_in_int8_as_one_rank_does(qwen3_ckpt: tuple
                                                                      ) -> None:
    """Every rank of a DCP group (peers: real processes, given the flag) serves the int8
    scheme: the group's greedy tokens are one rank's with the same scheme."""
    path, _ = qwen3_ckpt
    ps = prompts(seed=51, lengths=(40, 7))
    arrivals = {0: [greedy(f"r{i}", p, 12) for i, p in enumerate(ps)]}
    with dcp_engine(path, 2, dense_quantization="int8") as engine:
        assert engine.runner.model.dense_quantization == "int8"
        got = run_to_completion(engine, arrivals)
    assert got == run_to_completion(engine_for(path, dense_quantization="int8"), arrivals)
