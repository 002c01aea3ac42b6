"""The bundled default model: a small deterministic Qwen3-MoE checkpoint generated locally.

Its weights are random (seeded), so its answers are noise; it exists so that
`switchyard serve` works with no download. It is a normal HF directory (config.json,
model.safetensors, a byte-level tokenizer.json and a ChatML template in
tokenizer_config.json) that transformers loads too.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

DEMO_NAME = "switchyard-demo-random-v1"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 259,
    "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    "bos_token_id": 256, "eos_token_id": 258, "torch_dtype": "float32",
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("SWITCHYARD_CACHE_DIR", Path.home() / ".cache" / "switchyard"))


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Path of the demo checkpoint, generating it on first use (atomically)."""
    target = (cache_dir or default_cache_dir()) / DEMO_NAME
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".demo-"))
    try:
        write_demo_model(tmp)
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # not a concurrent writer that won
            raise
    return target


def build_tokenizer(special_tokens: list[str] = SPECIAL_TOKENS) -> Tokenizer:
    """Byte-level tokenizer: token id = byte value (0..255), then the special tokens."""
    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in _byte_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special_tokens)
    return tok


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ByteLevel pre-tokenizes to)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable}
    chars |= {b: chr(256 + i) for i, b in enumerate(others)}
    return chars


def write_demo_model(out: Path, seed: int = 0) -> None:
    cfg = CONFIG
    gen = torch.Generator().manual_seed(seed)
    h, d, heads, kv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    inter = cfg["moe_intermediate_size"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    tensors = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h),
               "model.norm.weight": torch.ones(h), "lm_head.weight": rand(cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        tensors |= {
            f"{p}.input_layernorm.weight": torch.ones(h),
            f"{p}.post_attention_layernorm.weight": torch.ones(h),
            f"{p}.self_attn.q_proj.weight": rand(heads * d, h),
            f"{p}.self_attn.k_proj.weight": rand(kv * d, h),
            f"{p}.self_attn.v_proj.weight": rand(kv * d, h),
            f"{p}.self_attn.o_proj.weight": rand(h, heads * d),
            f"{p}.self_attn.q_norm.weight": torch.ones(d),
            f"{p}.self_attn.k_norm.weight": torch.ones(d),
            f"{p}.mlp.gate.weight": rand(cfg["num_experts"], h),
        }
        for e in range(cfg["num_experts"]):
            tensors |= {f"{p}.mlp.experts.{e}.gate_proj.weight": rand(inter, h),
                        f"{p}.mlp.experts.{e}.up_proj.weight": rand(inter, h),
                        f"{p}.mlp.experts.{e}.down_proj.weight": rand(h, inter)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    build_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": cfg["max_position_embeddings"],
    }, indent=2))
