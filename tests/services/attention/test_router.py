"""The router picks what transformers' routers pick, on adversarial scores: ties within
and across group boundaries, and score-correction biases that flip a choice."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.attention.router import route
from services.model.config import ModelConfig, Routing

E = 16  # experts; the gate is the identity, so that a row's logits are the row itself


def _transformers_router(family: str, **overrides: object) -> torch.nn.Module:
    from tests.support import checkpoints

    if family == "v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3TopkRouter as Router,
        )
        config = checkpoints.deepseek_v3_config(hidden_size=E, n_routed_experts=E, **overrides)
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
            DeepseekV2TopkRouter as Router,
        )
        config = checkpoints.deepseek_v2_config(hidden_size=E, n_routed_experts=E,
                                                **overrides)
    router = Router(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    return router


def _routing(family: str, **overrides: object) -> Routing:
    from tests.support import checkpoints

    build = checkpoints.deepseek_v3_config if family == "v3" else checkpoints.deepseek_v2_config
    config = build(hidden_size=E, n_routed_experts=E, **overrides)
    raw = config.to_dict() | {"architectures": [
        "DeepseekV3ForCausalLM" if family == "v3" else "DeepseekV2ForCausalLM"]}
    return ModelConfig.from_hf(raw).routing_spec


def _check(family: str, logits: torch.Tensor, bias: torch.Tensor | None = None,
           **overrides: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Our choice (sorted per row) and its weights equal transformers', for logits [T, E]."""
    router = _transformers_router(family, **overrides)
    if bias is not None:
        router.e_score_correction_bias.copy_(bias)
    with torch.no_grad():
        _, want_w, want_ids = router(logits)
    ids, weights = route(logits, torch.eye(E), _routing(family, **overrides), bias)
    order, want_order = ids.argsort(dim=-1), want_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    assert torch.allclose(weights.gather(1, order), want_w.gather(1, want_order),
                          rtol=1e-6, atol=1e-7)
    return ids, weights


def test_a_bias_flips_the_choice_but_not_the_weights() -> None:
    """Expert 0 scores highest, but the bias makes experts 14 and 15 win; their weights
    are their own unbiased scores, renormalised and scaled."""
    logits = torch.linspace(2.0, -2.0, E)[None]  # expert 0 best
    bias = torch.zeros(E)
    bias[14:] = 5.0
    ids, weights = _check("v3", logits, bias, n_group=4, topk_group=2, num_experts_per_tok=2)
    assert sorted(ids[0].tolist()) == [14, 15]
    scores = logits[0, 14:].sigmoid()
    assert torch.allclose(weights[0].sort().values, (scores / scores.sum() * 2.5).sort().values)


def test_ties_across_group_boundaries() -> None:
    """Every group scores the same: which groups compete is torch's tie-break, taken
    the same way; ties inside the chosen groups too."""
    logits = torch.tensor([[1.0, 0.5] * (E // 2), [0.0] * E, [1.0] * 4 + [0.0] * (E - 4)])
    for n_group, topk_group in [(4, 2), (8, 3), (2, 1)]:
        _check("v3", logits, None, n_group=n_group, topk_group=topk_group,
               num_experts_per_tok=2)
        _check("v2", logits.softmax(-1).log(), None, topk_method="group_limited_greedy",
               n_group=n_group, topk_group=topk_group, num_experts_per_tok=2)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([-1.0, 0.0, 0.25, 1.0]), min_size=3 * E, max_size=3 * E),
       st.lists(st.sampled_from([-0.5, 0.0, 0.5]), min_size=E, max_size=E),
       st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 4), (8, 3)]), st.integers(1, 4))
def test_fuzzed_scores_with_ties_route_as_transformers(
        values: list[float], bias: list[float], groups: tuple[int, int], top_k: int) -> None:
    """Few distinct logits (many ties) and biases, over group settings: V3's noaux_tc and
    V2's group-limited greedy pick transformers' experts with its weights."""
    logits = torch.tensor(values).view(3, E)
    n_group, topk_group = groups
    top_k = min(top_k, topk_group * E // n_group)
    _check("v3", logits, torch.tensor(bias), n_group=n_group, topk_group=topk_group,
           num_experts_per_tok=top_k)
    if n_group > 1:
        _check("v2", logits, None, topk_method="group_limited_greedy", n_group=n_group,
               topk_group=topk_group, num_experts_per_tok=top_k)
    _check("v2", logits, None, num_experts_per_tok=top_k)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([-1.0, 0.0, 0.25, 1.0]), min_size=5 * E, max_size=5 * E),
       st.lists(st.sampled_from([-0.5, 0.0, 0.5]), min_size=E, max_size=E),
       st.sampled_from([(2, 1), (4, 2), (8, 3)]), st.integers(1, 4), st.booleans())
def test_the_compiled_group_router_is_the_torch_one_bit_for_bit(
        values: list[float], bias: list[float], groups: tuple[int, int], top_k: int,
        v3: bool) -> None:
    """On the CPU in float32 with the gate in panels the group-limited routers run as one
    compiled call of the same torch operations: the same experts in the same order, the
    same weights, ties included."""
    from moe_kernels.cpu_kernels import cpu_kernels
    from moe_kernels.panels import PanelWeights
    from moe_kernels.selection import panels_for_cpu

    if cpu_kernels() is None:
        pytest.skip("the CPU kernels are not built here")
    n_group, topk_group = groups
    top_k = min(top_k, topk_group * E // n_group)
    routing = Routing(top_k, v3, "sigmoid" if v3 else "softmax",
                      "noaux_tc" if v3 else "group_limited_greedy", n_group, topk_group, 2.5)
    x = torch.tensor(values).view(5, E)
    panels = panels_for_cpu(torch.eye(E), pad=True)
    assert isinstance(panels, PanelWeights)
    b = torch.tensor(bias) if v3 else None
    got, want = route(x, panels, routing, b), route(x, torch.eye(E), routing, b)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
