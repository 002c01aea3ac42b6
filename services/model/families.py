"""What differs between the model families, as the project's own config parts: how a MoE
layer routes (`Routing`), DeepSeek's latent attention (`MLA`), the rotary embedding
(`Rope`) and shared experts (`SharedExperts`). It also holds their translation from a
Hugging Face `config.json`, each refusing what is not built, naming the field.

`ModelConfig.from_dir` (`services.model.config`) reads them for Qwen3-MoE, Mixtral,
Qwen2-MoE, DeepSeek-V2 (and V2-Lite's layout) and DeepSeek-V3. These are refused, naming the
field: `topk_method`, `scoring_func`, `n_group`/`topk_group`, `attention_bias` and
`hidden_act` values that are not built; a rope type other than `default` or `yarn`; and
V2's `norm_topk_prob`, which transformers' V2 router ignores. Each part is read where it is
used:

- `Routing` (`services/attention/router.py`) has three methods. `greedy` is softmax top-k,
  for Qwen, Mixtral and V2-Lite; on the CPU it is one compiled call. V2's
  `group_limited_greedy` scores a group by its best expert and masks the other groups'
  scores to 0.0. V3's `noaux_tc` chooses by sigmoid scores plus the layer's
  `e_score_correction_bias`, scoring a group by its top two and masking the others to -inf.
  Its weights are the unbiased scores, renormalised, times `routed_scaling_factor`. The
  torch operations are transformers' own, unsorted top-k included, so ties fall the same
  way. tests/services/attention/test_router.py fuzzes tied scores and flipping biases
  against transformers' routers.
- `SharedExperts`: DeepSeek's `shared_experts` (n_shared_experts x moe_intermediate_size)
  and Qwen2-MoE's `shared_expert`, behind a sigmoid gate, run in the attention service. They
  run as one SwiGLU MLP beside the dispatch, added to the routed experts' combined output.
  Unlike SGLang's shared-expert fusion, they are not sent to the expert services. Every
  token needs them, so dispatching them would send every row once more per layer over the
  wire, and every expert rank would take a copy of the one expert all tokens hit. Here they
  read their weights once per step, like any dense layer. The attention service keeps no
  other FFN weights than these and the dense layers' (`first_k_dense_replace`,
  `moe_layer_freq`). `switchyard quantize` quantizes the routed experts only; the shared
  ones stay in the checkpoint's dtype, as the dense layers do.
- `Rope`: `default`, or `yarn`, with the scaled frequencies and the cos/sin factor of
  transformers' `_compute_yarn_parameters`. With MLA the softmax scale takes YaRN's mscale
  squared, as DeepSeek's does. DeepSeek's rotary pairs are interleaved (`rope_interleave`,
  and V2's complex rotation), which `apply_rope(interleaved=True)` handles.
- `MLA` (`services/attention/mla.py`): multi-head latent attention over a cache of latents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file or tensor."""


@dataclass(frozen=True)
class Routing:
    """How a MoE layer's gate picks its experts, as transformers' router of the
    architecture does.

    - `greedy`: top-k of the scores (Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V2-Lite).
    - `group_limited_greedy` (DeepSeek-V2): the experts are split into `n_group` groups,
      each scored by its best expert. The experts of the top `topk_group` groups compete,
      and the others' scores are masked to 0.0.
    - `noaux_tc` (DeepSeek-V3): sigmoid scores plus the layer's `e_score_correction_bias`
      choose. Each group is scored by its top two experts, and the others are masked to
      -inf. The weights are the unbiased scores.
    Weights are renormalised where `normalize`, then multiplied by `scaling`
    (`routed_scaling_factor`).
    """

    top_k: int
    normalize: bool
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    method: str = "greedy"  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention (DeepSeek-V2/V3). The cache holds, per token and layer,
    the latent [kv_lora_rank] and the rotary key [qk_rope_head_dim], shared by all heads."""

    q_lora_rank: int | None  # None: one q_proj (V2-Lite); else q_a_proj, norm, q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs (2i, 2i+1), as the checkpoints' weights are laid out

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class Rope:
    """Rotary embedding: `default`, or `yarn` (DeepSeek-V3's long-context scaling)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # None: from factor, mscale and mscale_all_dim
    truncate: bool = True


@dataclass(frozen=True)
class SharedExperts:
    """Experts every token of a MoE layer runs: DeepSeek's `shared_experts`, Qwen2-MoE's
    `shared_expert`. They are one SwiGLU MLP of `intermediate_size`, whose output is added
    to the routed experts'. With `gated`, it is first scaled by
    sigmoid(shared_expert_gate(x))."""

    intermediate_size: int
    gated: bool
    prefix: str  # where the checkpoint keeps them: "mlp.shared_experts", "mlp.shared_expert"


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `scale` times the trained one."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def first_key(raw: dict[str, Any], *keys: str) -> str:
    return next((k for k in keys if k in raw), keys[0])


def int_field(raw: dict[str, Any], key: str) -> int:
    if not isinstance(raw.get(key), int):
        raise CheckpointError(f"field {key!r} must be an integer, got {raw.get(key)!r}")
    return int(raw[key])


def rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 nests rope settings in `rope_parameters`; older ones use top-level keys.
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def parse_rope(raw: dict[str, Any]) -> Rope:
    params = rope_params(raw)
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if kind == "default":
        return Rope(theta)
    if kind != "yarn":
        raise CheckpointError(f"field 'rope_scaling' (rope_parameters): rope type {kind!r} is "
                              f"not supported (only 'default' and 'yarn')")
    if not isinstance(params.get("original_max_position_embeddings"), int):
        raise CheckpointError("field 'rope_scaling' (rope_parameters): yarn needs an integer "
                              "'original_max_position_embeddings'")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or int_field(raw, "max_position_embeddings") / original
    attention_factor = params.get("attention_factor")
    return Rope(theta, "yarn", float(factor), original,
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(
                    params.get("beta_slow") or 1),
                mscale=float(params.get("mscale") or 0),
                mscale_all_dim=float(params.get("mscale_all_dim") or 0),
                attention_factor=None if attention_factor is None else float(attention_factor),
                truncate=bool(params.get("truncate", True)))


def deepseek_routing(raw: dict[str, Any], arch: str, num_experts: int) -> Routing:
    v3 = arch == "DeepseekV3ForCausalLM"
    methods = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    method = raw.get("topk_method", methods[0])
    if method not in methods:
        raise CheckpointError(f"field 'topk_method' {method!r} is not supported for {arch}; "
                              f"supported: {', '.join(methods)}")
    scoring = "sigmoid" if v3 else "softmax"
    if raw.get("scoring_func", scoring) != scoring:
        raise CheckpointError(f"field 'scoring_func' {raw['scoring_func']!r} is not supported "
                              f"for {arch}; supported: {scoring!r}")
    normalize = bool(raw.get("norm_topk_prob", v3))
    if normalize and not v3:  # transformers' V2 router never renormalises; DeepSeek's may
        raise CheckpointError(f"field 'norm_topk_prob': true is not supported for {arch}")
    top_k = int_field(raw, "num_experts_per_tok")
    n_group, topk_group = 1, 1
    if method != "greedy":
        n_group, topk_group = int_field(raw, "n_group"), int_field(raw, "topk_group")
        if n_group < 1 or num_experts % n_group:
            raise CheckpointError(f"field 'n_group' {n_group} must divide n_routed_experts "
                                  f"({num_experts})")
        per_group = num_experts // n_group
        if not 1 <= topk_group <= n_group or top_k > topk_group * per_group:
            raise CheckpointError(f"field 'topk_group' {topk_group} must be in 1..n_group "
                                  f"({n_group}) and leave num_experts_per_tok ({top_k}) "
                                  f"experts to choose from")
        if v3 and per_group < 2:
            raise CheckpointError(f"field 'n_group' {n_group}: each group needs 2 experts "
                                  f"(a group is scored by its top two)")
    if top_k > num_experts:
        raise CheckpointError(f"field 'num_experts_per_tok' {top_k} exceeds n_routed_experts "
                              f"({num_experts})")
    return Routing(top_k, normalize, scoring, method, n_group, topk_group,
                   float(raw.get("routed_scaling_factor") or 1.0))
