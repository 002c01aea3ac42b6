"""The bundled default model, and the byte-level tokenizer that it and the trainer use.

`DEFAULT_MODEL` is a small DeepSeek-V3 (one MTP layer) trained by `training/train_demo.py` on
`switchyard.demo_task`: 3-digit addition and subtraction asked as chat. It is a normal HF
directory: config.json, model.safetensors, tokenizer.json and tokenizer_config.json with
the chat template; transformers loads it too.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

DEFAULT_MODEL = Path(__file__).parent / "models" / "arith-moe"
DEFAULT_MODEL_NAME = "switchyard-arith-moe"


def build_tokenizer(special_tokens: list[str]) -> Tokenizer:
    """Byte-level tokenizer: token id = byte value (0..255), then the special tokens."""
    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in _byte_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special_tokens)
    return tok


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte, which is what ByteLevel
    pre-tokenizes to."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable}
    chars |= {b: chr(256 + i) for i, b in enumerate(others)}
    return chars
