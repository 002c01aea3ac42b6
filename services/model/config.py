"""The project's own model config, translated once from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                           "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file or tensor."""


@dataclass(frozen=True)
class Routing:
    """How a MoE layer's gate picks its experts, as transformers' router of the architecture.

    - `greedy`: top-k of the scores (Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V2-Lite).
    - `group_limited_greedy` (DeepSeek-V2): the experts split into `n_group` groups, a
      group scored by its best expert; the top `topk_group` groups' experts compete, the
      others' scores are masked to 0.0.
    - `noaux_tc` (DeepSeek-V3): sigmoid scores plus the layer's `e_score_correction_bias`
      choose (a group scored by its top two experts, the others masked to -inf); the
      weights are the unbiased scores.
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
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds, per token and layer,
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
    """Experts every token of a MoE layer runs (DeepSeek's `shared_experts`, Qwen2-MoE's
    `shared_expert`): one SwiGLU MLP of `intermediate_size`, its output added to the
    routed experts'; with `gated`, first scaled by sigmoid(shared_expert_gate(x))."""

    intermediate_size: int
    gated: bool
    prefix: str  # where the checkpoint keeps them: "mlp.shared_experts", "mlp.shared_expert"


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about a model's shape.

    `moe_layers[i]` is True when decoder layer i has a sparse MoE block and False when it
    has a dense MLP of `intermediate_size` (Qwen3-MoE's `mlp_only_layers`/`decoder_sparse_step`,
    DeepSeek's `first_k_dense_replace`/`moe_layer_freq`).

    With `mla`, the attention runs over the latent cache as one KV head of `head_dim` =
    kv_lora_rank + qk_rope_head_dim (`num_kv_heads` = 1).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    qk_norm: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    sliding_window: int | None
    tie_word_embeddings: bool
    moe_layers: tuple[bool, ...]
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    quantization: str | None = None  # "w4a4": experts stored as MXFP4 (switchyard quantize)
    routing: Routing | None = None  # None: greedy softmax top_k (`routing_spec`)
    mla: MLA | None = None
    shared_experts: SharedExperts | None = None
    rope: Rope | None = None  # None: default rotary of rope_theta (`rope_spec`)
    qkv_bias: bool = False  # Qwen2-MoE's q, k and v projections have biases
    mtp_layers: int = 0  # DeepSeek's multi-token-prediction layers: in the checkpoint, unused

    @property
    def moe_layer_ids(self) -> list[int]:
        """The decoder layers that have a sparse MoE block, in order."""
        return [i for i, is_moe in enumerate(self.moe_layers) if is_moe]

    @property
    def expert_prefix(self) -> str:
        return "block_sparse_moe" if self.architecture == "MixtralForCausalLM" else "mlp"

    @property
    def routing_spec(self) -> Routing:
        return self.routing or Routing(self.top_k, self.norm_topk_prob)

    @property
    def rope_spec(self) -> Rope:
        return self.rope or Rope(self.rope_theta)

    @property
    def rope_dim(self) -> int:
        """The rotated dims of a head: all of it, or MLA's decoupled rotary part."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_elements_per_token(self) -> int:
        """Cache elements a token takes in one layer: K and V of every KV head, or MLA's
        latent and rotary key once."""
        return self.head_dim if self.mla else 2 * self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale: 1/sqrt(head_dim); MLA's is 1/sqrt(qk_head_dim), times YaRN's
        mscale squared where the checkpoint gives `mscale_all_dim` (transformers' and
        DeepSeek's `softmax_scale`)."""
        if self.mla is None:
            return self.head_dim ** -0.5
        rope, scale = self.rope_spec, self.mla.qk_head_dim ** -0.5
        if rope.kind != "default" and rope.mscale_all_dim:
            scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        return scale

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (a checkpoint directory needs config.json)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
        try:
            config = cls.from_hf(raw)
        except CheckpointError as exc:
            raise CheckpointError(f"{path}: {exc}") from exc
        extra = _generation_eos(Path(model_dir) / "generation_config.json")
        eos = config.eos_token_ids + tuple(t for t in extra if t not in config.eos_token_ids)
        return dataclasses.replace(config, eos_token_ids=eos)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"unsupported architecture {archs}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"field 'hidden_act' {raw['hidden_act']!r} is not supported "
                                  f"(only 'silu')")
        rope = _rope(raw)
        if arch in DEEPSEEK:
            return _deepseek(raw, arch, rope)
        if raw.get("attention_bias"):
            raise CheckpointError("attention_bias=true is not supported yet")
        hidden = _int(raw, "hidden_size")
        num_heads = _int(raw, "num_attention_heads")
        num_layers = _int(raw, "num_hidden_layers")
        mixtral = arch == "MixtralForCausalLM"
        num_experts = _int(raw, "num_local_experts" if mixtral else _first(raw, "num_experts",
                                                                            "num_local_experts"))
        sliding = raw.get("sliding_window")
        if not mixtral and not raw.get("use_sliding_window", False):
            sliding = None
        qwen2 = arch == "Qwen2MoeForCausalLM"
        shared = SharedExperts(_int(raw, "shared_expert_intermediate_size"), gated=True,
                               prefix="mlp.shared_expert") \
            if qwen2 and raw.get("shared_expert_intermediate_size") else None
        return cls(
            **_common(raw, arch, rope),
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            moe_intermediate_size=_int(raw, "intermediate_size" if mixtral
                                       else "moe_intermediate_size"),
            num_experts=num_experts,
            norm_topk_prob=True if mixtral else bool(raw.get("norm_topk_prob", False)),
            qk_norm=arch == "Qwen3MoeForCausalLM",
            sliding_window=int(sliding) if sliding else None,
            moe_layers=_moe_layers(raw, num_layers, mixtral),
            shared_experts=shared,
            qkv_bias=qwen2 and bool(raw.get("qkv_bias", True)),
        )


def _common(raw: dict[str, Any], arch: str, rope: Rope) -> dict[str, Any]:
    """The fields every architecture spells the same way."""
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return dict(
        architecture=arch,
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=_int(raw, "hidden_size"),
        num_layers=_int(raw, "num_hidden_layers"),
        num_heads=_int(raw, "num_attention_heads"),
        intermediate_size=_int(raw, "intermediate_size"),
        top_k=_int(raw, "num_experts_per_tok"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope.theta,
        rope=rope if rope.kind != "default" else None,
        max_position_embeddings=_int(raw, "max_position_embeddings"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        quantization=_quantization(raw),
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `scale` times the trained one."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _generation_eos(path: Path) -> tuple[int, ...]:
    """The end-of-sequence ids of `generation_config.json`, if there is one: generation
    stops at these too, as in transformers' `generate` and vLLM (e.g. Qwen3 adds
    <|endoftext|> to config.json's <|im_end|>)."""
    if not path.is_file():
        return ()
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not a JSON object ({exc})") from exc
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{path}: eos_token_id must be an int or a list of ints")
    return tuple(ids)


QUANT_METHOD = "switchyard_mxfp4"  # what `switchyard quantize` writes in quantization_config


QUANTIZATIONS = ("auto", "none", "w4a4")  # what --quantization accepts


def check_quantization(config: ModelConfig, requested: str) -> str | None:
    """The quantization to serve with (None: the checkpoint's dtype). `requested` is
    --quantization: "auto" takes the checkpoint's, "none" insists on float experts."""
    if requested not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {requested!r}; choose one of "
                         f"{', '.join(QUANTIZATIONS)}")
    if config.quantization and requested not in ("auto", config.quantization):
        raise ValueError(f"the checkpoint is quantized as {config.quantization}: serve it with "
                         f"--quantization {config.quantization} or auto")
    quantization = config.quantization if requested == "auto" else requested
    quantization = None if quantization == "none" else quantization
    if quantization == "w4a4":
        from moe_kernels.mxfp4 import check_blockable  # torch: only where W4A4 is asked for

        check_blockable(config.hidden_size)
        check_blockable(config.moe_intermediate_size)
    return quantization


def _quantization(raw: dict[str, Any]) -> str | None:
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != QUANT_METHOD:
        raise CheckpointError(f"unsupported quantization_config quant_method {method!r}; "
                              f"supported: {QUANT_METHOD!r} (written by `switchyard quantize`)")
    return "w4a4"


def _first(raw: dict[str, Any], *keys: str) -> str:
    return next((k for k in keys if k in raw), keys[0])


def _int(raw: dict[str, Any], key: str) -> int:
    if not isinstance(raw.get(key), int):
        raise CheckpointError(f"field {key!r} must be an integer, got {raw.get(key)!r}")
    return int(raw[key])


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 nests rope settings in `rope_parameters`; older ones use top-level keys.
    return raw.get("rope_parameters") or raw.get("rope_scaling") or {}


def _rope(raw: dict[str, Any]) -> Rope:
    params = _rope_params(raw)
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
    factor = params.get("factor") or _int(raw, "max_position_embeddings") / original
    attention_factor = params.get("attention_factor")
    return Rope(theta, "yarn", float(factor), original,
                beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(
                    params.get("beta_slow") or 1),
                mscale=float(params.get("mscale") or 0),
                mscale_all_dim=float(params.get("mscale_all_dim") or 0),
                attention_factor=None if attention_factor is None else float(attention_factor),
                truncate=bool(params.get("truncate", True)))


def _deepseek(raw: dict[str, Any], arch: str, rope: Rope) -> ModelConfig:
    """DeepSeek-V2/V3 (and their relatives' layout): MLA, shared experts, dense first layers
    and group-limited routing, as transformers' modeling code reads its config."""
    v3 = arch == "DeepseekV3ForCausalLM"
    if raw.get("attention_bias"):
        raise CheckpointError("field 'attention_bias': true is not supported for MLA")
    num_layers, num_experts = _int(raw, "num_hidden_layers"), _int(raw, "n_routed_experts")
    routing = _deepseek_routing(raw, arch, num_experts)
    q_lora = raw.get("q_lora_rank")
    if q_lora is not None and not isinstance(q_lora, int):
        raise CheckpointError(f"field 'q_lora_rank' must be an integer or null, got {q_lora!r}")
    interleave = raw.get("rope_interleave", True) if v3 else True  # V2 rotates complex pairs
    mla = MLA(q_lora, _int(raw, "kv_lora_rank"), _int(raw, "qk_nope_head_dim"),
              _int(raw, "qk_rope_head_dim"), _int(raw, "v_head_dim"), bool(interleave))
    first_dense, freq = int(raw.get("first_k_dense_replace") or 0), int(
        raw.get("moe_layer_freq") or 1)
    shared = int(raw.get("n_shared_experts") or 0)
    moe_inter = _int(raw, "moe_intermediate_size")
    return ModelConfig(
        **_common(raw, arch, rope),
        num_kv_heads=1,
        head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
        moe_intermediate_size=moe_inter,
        num_experts=num_experts,
        norm_topk_prob=routing.normalize,
        qk_norm=False,
        sliding_window=None,
        moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(num_layers)),
        routing=routing,
        mla=mla,
        shared_experts=SharedExperts(moe_inter * shared, gated=False,
                                     prefix="mlp.shared_experts") if shared else None,
        mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
    )


def _deepseek_routing(raw: dict[str, Any], arch: str, num_experts: int) -> Routing:
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
    top_k = _int(raw, "num_experts_per_tok")
    n_group, topk_group = 1, 1
    if method != "greedy":
        n_group, topk_group = _int(raw, "n_group"), _int(raw, "topk_group")
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


def _moe_layers(raw: dict[str, Any], num_layers: int, mixtral: bool) -> tuple[bool, ...]:
    if mixtral:
        return (True,) * num_layers
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    return tuple(i not in dense and step > 0 and (i + 1) % step == 0 for i in range(num_layers))
