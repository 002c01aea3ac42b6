"""The project's own model config, translated once from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file or tensor."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine needs to know about a model's shape.

    `moe_layers[i]` is True when decoder layer i has a sparse MoE block and False when it
    has a dense MLP of `intermediate_size` (Qwen3-MoE's `mlp_only_layers`/`decoder_sparse_step`).
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

    @property
    def moe_layer_ids(self) -> list[int]:
        """The decoder layers that have a sparse MoE block, in order."""
        return [i for i, is_moe in enumerate(self.moe_layers) if is_moe]

    @property
    def expert_prefix(self) -> str:
        return "block_sparse_moe" if self.architecture == "MixtralForCausalLM" else "mlp"

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
        _check_rope(raw)
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
        quantization = _quantization(raw)
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            intermediate_size=_int(raw, "intermediate_size"),
            moe_intermediate_size=_int(raw, "intermediate_size" if mixtral
                                       else "moe_intermediate_size"),
            num_experts=num_experts,
            top_k=_int(raw, "num_experts_per_tok"),
            norm_topk_prob=True if mixtral else bool(raw.get("norm_topk_prob", False)),
            qk_norm=not mixtral,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=_int(raw, "max_position_embeddings"),
            sliding_window=int(sliding) if sliding else None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            moe_layers=_moe_layers(raw, num_layers, mixtral),
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            quantization=quantization,
        )


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


def _check_rope(raw: dict[str, Any]) -> None:
    rope_type = _rope_params(raw).get("rope_type", _rope_params(raw).get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"rope type {rope_type!r} is not supported yet (only 'default')")


def _rope_theta(raw: dict[str, Any]) -> float:
    return float(_rope_params(raw).get("rope_theta", raw.get("rope_theta", 10000.0)))


def _moe_layers(raw: dict[str, Any], num_layers: int, mixtral: bool) -> tuple[bool, ...]:
    if mixtral:
        return (True,) * num_layers
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(raw.get("mlp_only_layers") or [])
    return tuple(i not in dense and step > 0 and (i + 1) % step == 0 for i in range(num_layers))
