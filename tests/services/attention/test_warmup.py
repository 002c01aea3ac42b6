"""`services.attention.warmup`: the warm-up generation `serve` runs before it says it
serves reaches every replica of every expert, and no other request finds its KV."""

from __future__ import annotations

import torch

from common.messages import GenerateRequest, SamplingParams
from ep_dispatch.layout import compute_layout
from ep_dispatch.placement import Placement
from services.attention.warmup import warmup_prompt
from tests.support.engines import engine_for, greedy


def test_a_warm_up_reaches_every_replica_of_every_expert(qwen3_ckpt: tuple) -> None:
    """The warm-up's rows are routed to experts by position so that a layout gives every
    replica of every expert a row, whatever replica turn a layer call starts at; its KV
    is never found by another request. Its rows count as load: R per expert."""
    engine = engine_for(qwen3_ckpt[0], dispatch_backend="local", expert_replicas=2,
                        max_num_batched_tokens=64)
    cfg, calls = engine.model_config, []
    inner = engine.runner.experts

    def recording(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
                  ) -> torch.Tensor:
        calls.append((layer, ids.clone()))
        return inner(layer, x, ids, w)

    engine.runner.experts = recording  # type: ignore[assignment]
    engine.runner.experts.begin_step = inner.begin_step  # type: ignore[attr-defined]
    warmup = GenerateRequest("w", [], SamplingParams(max_tokens=1, temperature=0.0),
                             warmup=True)
    assert engine.add(warmup) is None
    [delta] = engine.step()
    assert (delta.finish_reason, delta.error) == ("length", None)
    assert [layer for layer, _ in calls] == cfg.moe_layer_ids
    placement = Placement.balanced(cfg.moe_layer_ids, cfg.num_experts, 3, replicas=2)
    for layer, ids in calls:
        for turn in range(3):
            layout = compute_layout(ids, torch.ones_like(ids, dtype=torch.float32),
                                    placement, layer, turn)
            assert all(all(c > 0 for c in counts) for counts in layout.expert_counts), (
                layer, turn, layout.expert_counts)
    load = engine.runner.model.expert_load  # [layers, E]
    moe = len(cfg.moe_layer_ids)
    assert (load[cfg.moe_layer_ids] == 2).all() and int(load.sum()) == 2 * cfg.num_experts * moe
    prompt = warmup_prompt(cfg, 2, engine.max_model_len)
    assert engine.add(greedy("same tokens", prompt, 1)) is None
    [delta] = engine.step()
    assert delta.num_cached_tokens == 0
