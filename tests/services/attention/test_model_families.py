"""Qwen2-MoE and the DeepSeek family (MLA, shared experts, group-limited routing, YaRN)
against transformers' models of the same random checkpoints: greedy outputs preempted
and through the prefix cache, and the MLA cache's contents (their logits and batched
greedy outputs: test_engine_parity.py, over every architecture)."""

from __future__ import annotations

import torch

from services.attention.kv_cache import kv_bytes_per_block
from services.attention.sequence import Sequence
from services.model.config import ModelConfig
from tests.support.engines import (
    engine_for,
    greedy,
    prompts,
    reference_greedy,
    run_to_completion,
)


def test_preempted_and_prefix_cached_sequences_generate_what_transformers_does(
        family_ckpt: tuple) -> None:
    """Under block pressure sequences are preempted and recomputed (or take their own
    cached blocks back); then requests sharing a prompt find it in the prefix cache."""
    path, model = family_ckpt
    ps = prompts(seed=5, lengths=(20, 17, 25, 14))
    per_block = kv_bytes_per_block(ModelConfig.from_dir(path), 4, torch.float32)
    engine = engine_for(path, block_size=4, kv_cache_memory=per_block * 24,
                        max_num_batched_tokens=16)
    got = run_to_completion(engine, {0: [greedy(f"r{i}", p, 24) for i, p in enumerate(ps)]})
    assert engine.scheduler.num_preemptions > 0
    assert got == {f"r{i}": reference_greedy(model, p, 24) for i, p in enumerate(ps)}

    system = prompts(seed=61, lengths=(37,))[0]
    shared = {"a": [*system, 7, 8], "b": [*system, 9], "c": [*system, 7, 8]}
    cached: dict[str, int | None] = {}
    engine = engine_for(path, block_size=16, max_num_batched_tokens=12)
    out = run_to_completion(engine, {0: [greedy("a", shared["a"], 12)]})
    out |= run_to_completion(engine, {0: [greedy(k, shared[k], 12) for k in ("b", "c")]},
                             lambda d: cached.setdefault(d.request_id, d.num_cached_tokens))
    assert cached == {"b": 32, "c": 32}  # whole blocks of the system prompt
    assert out == {k: reference_greedy(model, p, 12) for k, p in shared.items()}


def test_mla_cache_rows_are_transformers_latent_and_rotary_key(
        deepseek_v3_ckpt: tuple) -> None:
    """Each token's row in a layer's cache is [kv_a_layernorm(latent), rotated k_pe]:
    what transformers' own cache holds for that layer (its keys and values) and nothing
    per head; K and V are the same tensor."""
    path, model = deepseek_v3_ckpt
    prompt = prompts(seed=8, lengths=(21,))[0]
    engine = engine_for(path, block_size=8, max_num_batched_tokens=32)
    tables: list[list[int]] = []
    free = engine.block_manager.free

    def keep(seq: Sequence) -> None:
        tables.append(list(seq.block_tables[0]))
        free(seq)

    engine.block_manager.free = keep  # type: ignore[method-assign]
    run_to_completion(engine, {0: [greedy("r", prompt, 1)]})  # the prompt's KV only
    slots = torch.tensor([tables[0][j // 8] * 8 + j % 8 for j in range(len(prompt))])
    with torch.no_grad():
        cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    mla = engine.model_config.mla
    assert mla is not None
    for layer in range(engine.model_config.num_layers):
        assert engine.runner.kv.v[layer] is engine.runner.kv.k[layer]
        rows = engine.runner.kv.k[layer][slots]  # [L, 1, kv_lora + rope]
        assert rows.shape == (len(prompt), 1, mla.kv_lora_rank + mla.qk_rope_head_dim)
        latent, k_pe = cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]
        assert (rows[:, 0, : mla.kv_lora_rank] - latent).abs().max() < 1e-5
        assert (rows[:, 0, mla.kv_lora_rank:] - k_pe).abs().max() < 1e-5


def test_mla_cache_bytes_per_token_against_the_same_model_with_mha(
        deepseek_v3_ckpt: tuple) -> None:
    """A block's bytes, from transformers' config: per layer and token, the latent and the
    rotary key once; multi-head attention with the same heads would hold each head's key
    (qk_head_dim) and value (v_head_dim)."""
    path, model = deepseek_v3_ckpt
    c = model.config
    engine = engine_for(path, kv_cache_memory=1 << 20, block_size=16)
    mla_token = c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    mha_token = c.num_hidden_layers * c.num_attention_heads * (
        c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 4
    per_block = kv_bytes_per_block(engine.model_config, 16, torch.float32)
    assert per_block == 16 * mla_token
    assert engine.block_manager.num_blocks == (1 << 20) // per_block
    held = sum(t.nbytes for t in engine.runner.kv.k)  # (v is k)
    assert held == engine.block_manager.num_blocks * per_block
    assert mha_token > 4 * mla_token  # this tiny model: 48 floats against 4 x (32 + 24)
