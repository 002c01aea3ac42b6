"""Checkpoint translation and loading: clear errors that name the file or tensor."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.model.config import MLA, CheckpointError, ModelConfig, Rope, Routing, SharedExperts


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


def test_translates_qwen2_moe_and_the_deepseek_family(
        qwen2_moe_ckpt: tuple, deepseek_v2_grouped_ckpt: tuple, deepseek_v3_ckpt: tuple,
        deepseek_v3_yarn_ckpt: tuple) -> None:
    q = ModelConfig.from_dir(qwen2_moe_ckpt[0])
    assert (q.qkv_bias, q.shared_experts, q.moe_layers) == (
        True, SharedExperts(80, True, "mlp.shared_expert"), (True, False, True))
    v2 = ModelConfig.from_dir(deepseek_v2_grouped_ckpt[0])
    assert v2.routing == Routing(2, False, "softmax", "group_limited_greedy", 4, 2, 1.5)
    assert v2.mla == MLA(16, 32, 16, 16, 16, rope_interleave=True)
    assert (v2.num_kv_heads, v2.head_dim, v2.moe_layers) == (1, 48, (False, True, True))
    v3 = ModelConfig.from_dir(deepseek_v3_ckpt[0])
    assert v3.routing == Routing(3, True, "sigmoid", "noaux_tc", 4, 2, 2.5)
    assert v3.shared_experts == SharedExperts(64, False, "mlp.shared_experts")  # 2 x 32
    assert v3.mtp_layers == 0  # transformers' config says 1; its model saves none
    yarn = ModelConfig.from_dir(deepseek_v3_yarn_ckpt[0])
    assert yarn.rope == Rope(10000.0, "yarn", 4.0, 128, 32.0, 1.0, 1.0, 0.707)
    assert not yarn.mla.rope_interleave  # type: ignore[union-attr]
    assert yarn.attention_scale == pytest.approx(32 ** -0.5 * (0.0707 * math.log(4) + 1) ** 2)


def test_deepseek_mtp_layers_are_skipped_with_one_log_line(
        deepseek_v3_mtp_ckpt: tuple, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint with the multi-token-prediction layer after the decoder's (as
    DeepSeek-V3's model.layers.61.*) loads, serves the same logits without drafting,
    says what it left, and counts the MTP layer's MoE among those the experts serve."""
    path, model, _ = deepseek_v3_mtp_ckpt
    cfg = ModelConfig.from_dir(path)
    n = model.config.num_hidden_layers
    assert (cfg.mtp_layers, cfg.mtp_layer_ids) == (1, [n])
    assert cfg.served_moe_layers() == [*cfg.moe_layer_ids, n]
    assert cfg.served_moe_layers(mtp=False) == cfg.moe_layer_ids
    prompt = [5, 9, 2, 77]
    with caplog.at_level("INFO", logger="services.attention.builder"):
        got = build_engine(AttentionConfig(model=path, kv_cache_memory=1 << 20)).score(prompt)
    assert "skipping 1 multi-token-prediction layer(s) of the checkpoint (" in caplog.text
    with torch.no_grad():
        assert (got - model(torch.tensor([prompt])).logits[0]).abs().max() < 1e-4


V3 = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 256, "hidden_size": 64,
      "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
      "num_attention_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
      "n_group": 4, "topk_group": 2, "kv_lora_rank": 32, "q_lora_rank": 24,
      "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
      "max_position_embeddings": 512}


def test_deepseek_dense_layers_follow_first_k_dense_replace_and_moe_layer_freq() -> None:
    # DeepSeek's own modeling code: MoE where i >= first_k_dense_replace and
    # i % moe_layer_freq == 0 (transformers' reads only the first)
    layers = dict(V3, num_hidden_layers=6, first_k_dense_replace=1)
    assert ModelConfig.from_hf(layers).moe_layers == (False,) + (True,) * 5
    assert ModelConfig.from_hf(layers | {"moe_layer_freq": 2}).moe_layers == (
        False, False, True, False, True, False)


@pytest.mark.parametrize(("change", "field"), [
    ({"topk_method": "greedy"}, "'topk_method' 'greedy' is not supported"),
    ({"scoring_func": "softmax"}, "'scoring_func' 'softmax' is not supported"),
    ({"n_group": 3}, "'n_group' 3 must divide n_routed_experts"),
    ({"topk_group": 0}, "'topk_group' 0 must be in 1..n_group"),
    ({"n_group": 8, "topk_group": 1, "num_experts_per_tok": 1}, "each group needs 2 experts"),
    ({"kv_lora_rank": None}, "'kv_lora_rank' must be an integer"),
    ({"q_lora_rank": "24"}, "'q_lora_rank' must be an integer or null"),
    ({"attention_bias": True}, "'attention_bias'"),
    ({"hidden_act": "gelu"}, "'hidden_act' 'gelu' is not supported"),
    ({"rope_scaling": {"type": "longrope"}}, "rope type 'longrope' is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 4}}, "'original_max_position_embeddings'"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "topk_method": "noaux_tc"},
     "'topk_method' 'noaux_tc' is not supported for DeepseekV2ForCausalLM"),
    ({"architectures": ["DeepseekV2ForCausalLM"], "norm_topk_prob": True}, "'norm_topk_prob'"),
])
def test_a_deepseek_option_not_built_is_refused_naming_its_field(change: dict, field: str
                                                                 ) -> None:
    assert ModelConfig.from_hf(V3).mla is not None  # the unchanged config translates
    with pytest.raises(CheckpointError, match=re.escape(field)):
        ModelConfig.from_hf(V3 | change)


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
    assert engine.runner.model.embed.dtype == torch.bfloat16
    logits = engine.score([1, 2, 3])
    with torch.no_grad():
        ref = qwen3_ckpt[1](torch.tensor([[1, 2, 3]])).logits[0]
    assert (logits - ref).abs().max() < 0.1  # bf16 rounding, same model




def test_an_unreadable_weights_file_is_named(tmp_path: Path) -> None:
    """A `*.safetensors` file whose header is not one: a CheckpointError that names it,
    from the checkpoint and from the config's look for MTP layers (which then finds none,
    and leaves the error to the weights' loading)."""
    from services.model.checkpoint import Checkpoint

    (tmp_path / "config.json").write_text(json.dumps({**V3, "num_nextn_predict_layers": 1}))
    (tmp_path / "model.safetensors").write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00oops")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: unreadable safetensors"):
        Checkpoint(tmp_path)
    assert ModelConfig.from_dir(tmp_path).mtp_layers == 0
