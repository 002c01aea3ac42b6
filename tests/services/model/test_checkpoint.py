"""Checkpoint translation and loading: clear errors that name the file or tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.model.config import CheckpointError, ModelConfig


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_translates_qwen3_and_mixtral(qwen3_ckpt: tuple, mixtral_ckpt: tuple) -> None:
    q = ModelConfig.from_dir(qwen3_ckpt[0])
    assert (q.architecture, q.num_experts, q.top_k, q.qk_norm) == ("Qwen3MoeForCausalLM", 8, 2,
                                                                    True)
    assert q.moe_layers == (True, False, True)  # mlp_only_layers=[1]
    m = ModelConfig.from_dir(mixtral_ckpt[0])
    assert (m.num_experts, m.top_k, m.norm_topk_prob, m.qk_norm) == (6, 3, True, False)
    assert (mixtral_ckpt[0] / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize(("generation_eos", "want"), [
    ([255, 7], (255, 7)), (7, (255, 7)), (None, (255,)), ("absent", (255,))])
def test_generation_config_adds_its_end_of_sequence_ids(qwen3_ckpt: tuple, tmp_path: Path,
                                                         generation_eos: object,
                                                         want: tuple) -> None:
    """As transformers' `generate` and vLLM: Qwen3's generation_config.json adds
    <|endoftext|> to config.json's <|im_end|>."""
    path = copy(qwen3_ckpt[0], tmp_path / "m")
    assert ModelConfig.from_dir(path).eos_token_ids == (255,)  # config.json's
    file = path / "generation_config.json"
    if generation_eos == "absent":
        file.unlink()
    else:
        file.write_text(json.dumps({"eos_token_id": generation_eos, "temperature": 0.6}))
    assert ModelConfig.from_dir(path).eos_token_ids == want


@pytest.mark.parametrize("text", ["[1, 2]", "{", '{"eos_token_id": "2"}'])
def test_a_bad_generation_config_is_named(qwen3_ckpt: tuple, tmp_path: Path, text: str) -> None:
    path = copy(qwen3_ckpt[0], tmp_path / "m")
    (path / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"generation_config\.json: "):
        ModelConfig.from_dir(path)


def test_unsupported_architecture(qwen3_ckpt: tuple, tmp_path: Path) -> None:
    d = copy(qwen3_ckpt[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json.*unsupported architecture"):
        ModelConfig.from_dir(d)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        ModelConfig.from_dir(tmp_path)


def test_missing_tensor_named(qwen3_ckpt: tuple, tmp_path: Path) -> None:
    d = copy(qwen3_ckpt[0], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.mlp\.experts\.5\.up_proj"):
        build_engine(AttentionConfig(model=d))


def test_wrong_shape_names_file_and_tensor(mixtral_ckpt: tuple, tmp_path: Path) -> None:
    d = copy(mixtral_ckpt[0], tmp_path / "m")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = d / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = torch.zeros(3, 64)
    save_file(tensors, shard)
    want = rf"{shard.name}: tensor '{name}' has shape \[3, 64\]"
    with pytest.raises(CheckpointError, match=want):
        build_engine(AttentionConfig(model=d))


def test_missing_shard_named(mixtral_ckpt: tuple, tmp_path: Path) -> None:
    d = copy(mixtral_ckpt[0], tmp_path / "m")
    shard = sorted(d.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: missing"):
        build_engine(AttentionConfig(model=d))




def test_bfloat16_dtype_loads(qwen3_ckpt: tuple) -> None:
    engine = build_engine(AttentionConfig(model=qwen3_ckpt[0], dtype="bfloat16",
                                    kv_cache_memory=1 << 20))
    assert engine.model.embed.dtype == torch.bfloat16
    logits = engine.score([1, 2, 3])
    with torch.no_grad():
        ref = qwen3_ckpt[1](torch.tensor([[1, 2, 3]])).logits[0]
    assert (logits - ref).abs().max() < 0.1  # bf16 rounding, same model


