"""Tiny random MoE checkpoints built by transformers from a config (offline), the logits oracle."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported where used: it takes seconds
    from transformers import MixtralConfig, PretrainedConfig, PreTrainedModel, Qwen3MoeConfig

VOCAB = 256


def qwen3_moe_config(**overrides: object) -> Qwen3MoeConfig:
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
              max_position_embeddings=512, eos_token_id=VOCAB - 1, rope_theta=10000.0)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def mixtral_config(**overrides: object) -> MixtralConfig:
    from transformers import MixtralConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=1, num_local_experts=6,
              num_experts_per_tok=3, max_position_embeddings=512, eos_token_id=VOCAB - 1)
    kw.update(overrides)
    return MixtralConfig(**kw)


def build(config: PretrainedConfig, out_dir: Path, seed: int = 0,
          max_shard_size: str | None = None) -> PreTrainedModel:
    """Random-init the model (with larger-than-default weights so routing and logits vary),
    save it, and return the transformers model in float32 eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # (zeros) so that it flips choices
                b.normal_(0.0, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model


def qwen2_moe_config(**overrides: object) -> PretrainedConfig:
    """Qwen2-MoE: q/k/v biases and one shared expert behind a sigmoid gate."""
    from transformers import Qwen2MoeConfig

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              shared_expert_intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
              mlp_only_layers=[1], max_position_embeddings=512, eos_token_id=VOCAB - 1)
    kw.update(overrides)
    return Qwen2MoeConfig(**kw)


def deepseek_v3_config(**overrides: object) -> PretrainedConfig:
    """DeepSeek-V3: MLA with q_lora_rank, a dense first layer, 2 shared experts, sigmoid
    routing with a score-correction bias over 4 groups of which 2 compete."""
    from transformers import DeepseekV3Config

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, n_group=4,
              topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
              q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
              v_head_dim=24, max_position_embeddings=512, eos_token_id=VOCAB - 1)
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def deepseek_v2_config(**overrides: object) -> PretrainedConfig:
    """DeepSeek-V2-Lite's layout: MLA without q_lora_rank, softmax routing (greedy; pass
    topk_method="group_limited_greedy" with n_group/topk_group for V2's)."""
    from transformers import DeepseekV2Config

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=16, v_head_dim=16, max_position_embeddings=512,
              eos_token_id=VOCAB - 1)
    kw.update(overrides)
    return DeepseekV2Config(**kw)


def build_with_mtp(config: PretrainedConfig, out_dir: Path, seed: int = 0
                   ) -> tuple[PreTrainedModel, torch.nn.Module]:
    """`build`'s random DeepSeek-V3, with a random MTP layer saved as DeepSeek's
    checkpoints keep it (`training/train_demo.py`'s layout, model.layers.{n}.*): the
    model and the MTP module (`train_demo.forward` runs both, transformers' blocks)."""
    from training.train_demo import add_mtp_layer, save_mtp_checkpoint

    model = build(config, out_dir, seed)
    torch.manual_seed(seed + 1)
    mtp = add_mtp_layer(model)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.startswith(("shared_head.head", "embed_tokens")):
                continue  # (copies of the model's, written by the save)
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.08)
    save_mtp_checkpoint(model, mtp, out_dir)
    return model, mtp
