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
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return model
