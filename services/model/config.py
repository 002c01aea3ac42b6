"""The project's own model config, translated once from a Hugging Face `config.json`.

`ModelConfig.from_dir` translates a checkpoint's `config.json` once, with the families'
parts from `families`. At start-up it refuses an option that is not built, naming the field.
The model directory's `eos_token_id`s end generation, besides a request's own stop
conditions. It finds an MTP layer where its weights are (`mtp_layers`). On every backend but
`deepep`, `served_moe_layers` adds it to the MoE layers the expert ranks hold, so it is
placed, rebalanced and counted per expert as the decoder's layers are.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.model.families import (
    MLA,
    CheckpointError,
    Rope,
    Routing,
    SharedExperts,
    deepseek_routing,
    first_key,
    int_field,
    parse_rope,
    yarn_mscale,
)

__all__ = ["MLA", "CheckpointError", "ModelConfig", "Rope", "Routing", "SharedExperts",
           "check_dense_quantization", "check_quantization", "yarn_mscale"]

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM",
                           "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about a model's shape.

    `moe_layers[i]` is True when decoder layer i has a sparse MoE block, and False when it
    has a dense MLP of `intermediate_size`. Qwen3-MoE sets this with
    `mlp_only_layers`/`decoder_sparse_step`, DeepSeek with
    `first_k_dense_replace`/`moe_layer_freq`.

    With `mla`, the attention runs over the latent cache as one KV head (`num_kv_heads` = 1)
    of `head_dim` = kv_lora_rank + qk_rope_head_dim.
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
    dense_quantization: str | None = None  # "int8": dense linears in int8 (switchyard quantize)
    routing: Routing | None = None  # None: greedy softmax top_k (`routing_spec`)
    mla: MLA | None = None
    shared_experts: SharedExperts | None = None
    rope: Rope | None = None  # None: default rotary of rope_theta (`rope_spec`)
    qkv_bias: bool = False  # Qwen2-MoE's q, k and v projections have biases
    # DeepSeek's multi-token-prediction layers (`num_nextn_predict_layers`), as checkpoint
    # layers num_layers on; `from_dir` counts only those whose weights are there.
    mtp_layers: int = 0

    @property
    def moe_layer_ids(self) -> list[int]:
        """The decoder layers that have a sparse MoE block, in order."""
        return [i for i, is_moe in enumerate(self.moe_layers) if is_moe]

    @property
    def mtp_layer_ids(self) -> list[int]:
        """The checkpoint's MTP layers, each a decoder block with a MoE of its own."""
        return list(range(self.num_layers, self.num_layers + self.mtp_layers))

    def served_moe_layers(self, mtp: bool = True) -> list[int]:
        """The MoE layers whose experts the expert ranks hold: the decoder's, and with
        `mtp` the MTP layers'. `mtp` is a dispatch backend's `Backend.mtp`."""
        return self.moe_layer_ids + (self.mtp_layer_ids if mtp else [])

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
        """The softmax scale: 1/sqrt(head_dim). MLA's is 1/sqrt(qk_head_dim), times YaRN's
        mscale squared where the checkpoint gives `mscale_all_dim`, as in transformers' and
        DeepSeek's `softmax_scale`."""
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
        return dataclasses.replace(config, eos_token_ids=eos,
                                   mtp_layers=_mtp_layers_present(Path(model_dir), config))

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
        rope = parse_rope(raw)
        if arch in DEEPSEEK:
            return _deepseek(raw, arch, rope)
        if raw.get("attention_bias"):
            raise CheckpointError("attention_bias=true is not supported yet")
        hidden = int_field(raw, "hidden_size")
        num_heads = int_field(raw, "num_attention_heads")
        num_layers = int_field(raw, "num_hidden_layers")
        mixtral = arch == "MixtralForCausalLM"
        num_experts = int_field(raw, "num_local_experts" if mixtral
                                else first_key(raw, "num_experts", "num_local_experts"))
        sliding = raw.get("sliding_window")
        if not mixtral and not raw.get("use_sliding_window", False):
            sliding = None
        qwen2 = arch == "Qwen2MoeForCausalLM"
        shared = SharedExperts(int_field(raw, "shared_expert_intermediate_size"), gated=True,
                               prefix="mlp.shared_expert") \
            if qwen2 and raw.get("shared_expert_intermediate_size") else None
        return cls(
            **_common(raw, arch, rope),
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            moe_intermediate_size=int_field(raw, "intermediate_size" if mixtral
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
    experts_q, dense_q = _quantization(raw)
    return dict(
        architecture=arch,
        vocab_size=int_field(raw, "vocab_size"),
        hidden_size=int_field(raw, "hidden_size"),
        num_layers=int_field(raw, "num_hidden_layers"),
        num_heads=int_field(raw, "num_attention_heads"),
        intermediate_size=int_field(raw, "intermediate_size"),
        top_k=int_field(raw, "num_experts_per_tok"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope.theta,
        rope=rope if rope.kind != "default" else None,
        max_position_embeddings=int_field(raw, "max_position_embeddings"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
        quantization=experts_q,
        dense_quantization=dense_q,
    )


def _mtp_layers_present(model_dir: Path, config: ModelConfig) -> int:
    """How many of the config's MTP layers the checkpoint holds. transformers' DeepSeek
    models, for one, say 1 and save none."""
    if not config.mtp_layers:
        return 0
    try:
        names = tensor_files(model_dir)
    except CheckpointError:  # reported with its file when the weights are loaded
        return 0
    return sum(f"model.layers.{i}.eh_proj.weight" in names for i in config.mtp_layer_ids)


INDEX_FILE = "model.safetensors.index.json"


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Each tensor of a checkpoint directory and the file that holds it. For a sharded
    checkpoint this comes from the index, else from each `*.safetensors` file's header, an
    8-byte length then JSON. It is read without torch, which the launcher does not load."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {name: model_dir / f for name, f in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise CheckpointError(f"{path}: missing (listed in {index})")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    return {name: path for path in shards for name in _header_names(path)}


def _header_names(path: Path) -> list[str]:
    try:
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from exc
    return [name for name in header if name != "__metadata__"]


def _generation_eos(path: Path) -> tuple[int, ...]:
    """The end-of-sequence ids of `generation_config.json`, if there is one. Generation
    stops at these too, as in transformers' `generate` and vLLM. For example, Qwen3 adds
    <|endoftext|> to config.json's <|im_end|>."""
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


QUANT_METHOD = "switchyard"  # what `switchyard quantize` writes in quantization_config
LEGACY_QUANT_METHOD = "switchyard_mxfp4"  # its experts-only form before dense weights


QUANTIZATIONS = ("auto", "none", "w4a4")  # what --quantization accepts
DENSE_QUANTIZATIONS = ("auto", "none", "int8")  # what --dense-quantization accepts


def check_quantization(config: ModelConfig, requested: str) -> str | None:
    """The quantization to serve with; None means the checkpoint's dtype. `requested` is
    --quantization: "auto" takes the checkpoint's, and "none" insists on float experts."""
    quantization = _choose("quantization", QUANTIZATIONS, config.quantization, requested)
    if quantization == "w4a4":
        from moe_kernels.mxfp4 import check_blockable  # torch: only where W4A4 is asked for

        check_blockable(config.hidden_size)
        check_blockable(config.moe_intermediate_size)
    return quantization


def check_dense_quantization(config: ModelConfig, requested: str) -> str | None:
    """The dense linears' scheme to serve with; None means the model's dtype. It reads
    --dense-quantization as `check_quantization` reads --quantization."""
    return _choose("dense-quantization", DENSE_QUANTIZATIONS, config.dense_quantization,
                   requested)


def _choose(flag: str, choices: tuple[str, ...], stored: str | None, requested: str
            ) -> str | None:
    if requested not in choices:
        raise ValueError(f"unknown {flag} {requested!r}; choose one of {', '.join(choices)}")
    if stored and requested not in ("auto", stored):
        raise ValueError(f"the checkpoint is quantized as {stored}: serve it with "
                         f"--{flag} {stored} or auto")
    chosen = stored if requested == "auto" else requested
    return None if chosen == "none" else chosen


def _quantization(raw: dict[str, Any]) -> tuple[str | None, str | None]:
    """(the experts', the dense linears') quantization a checkpoint is stored in."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None, None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == LEGACY_QUANT_METHOD:
        return "w4a4", None
    if method != QUANT_METHOD:
        raise CheckpointError(f"unsupported quantization_config quant_method {method!r}; "
                              f"supported: {QUANT_METHOD!r} (written by `switchyard quantize`)")
    experts, dense = qc.get("experts"), qc.get("dense")
    if experts not in (None, "mxfp4") or dense not in (None, "int8"):
        raise CheckpointError(f"quantization_config: experts {experts!r} and dense {dense!r}; "
                              "supported: experts 'mxfp4', dense 'int8' (or absent)")
    return ("w4a4" if experts else None), dense


def _deepseek(raw: dict[str, Any], arch: str, rope: Rope) -> ModelConfig:
    """DeepSeek-V2/V3, and their relatives' layout: MLA, shared experts, dense first layers
    and group-limited routing. The config is read as transformers' modeling code reads
    it."""
    v3 = arch == "DeepseekV3ForCausalLM"
    if raw.get("attention_bias"):
        raise CheckpointError("field 'attention_bias': true is not supported for MLA")
    num_layers = int_field(raw, "num_hidden_layers")
    num_experts = int_field(raw, "n_routed_experts")
    routing = deepseek_routing(raw, arch, num_experts)
    q_lora = raw.get("q_lora_rank")
    if q_lora is not None and not isinstance(q_lora, int):
        raise CheckpointError(f"field 'q_lora_rank' must be an integer or null, got {q_lora!r}")
    interleave = raw.get("rope_interleave", True) if v3 else True  # V2 rotates complex pairs
    mla = MLA(q_lora, int_field(raw, "kv_lora_rank"), int_field(raw, "qk_nope_head_dim"),
              int_field(raw, "qk_rope_head_dim"), int_field(raw, "v_head_dim"), bool(interleave))
    first_dense, freq = int(raw.get("first_k_dense_replace") or 0), int(
        raw.get("moe_layer_freq") or 1)
    shared = int(raw.get("n_shared_experts") or 0)
    moe_inter = int_field(raw, "moe_intermediate_size")
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


def _moe_layers(raw: dict[str, Any], num_layers: int, mixtral: bool) -> tuple[bool, ...]:
    if mixtral:
        return (True,) * num_layers
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    return tuple(i not in dense and step > 0 and (i + 1) % step == 0 for i in range(num_layers))
