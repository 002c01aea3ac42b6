"""Structured outputs in the engine: each constrained sequence's llguidance matcher (its
grammar built and checked by the gateway), the tokens it allows at each step, and the
tokens it consumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class Grammars:
    """Matchers over the model's tokenizer, which is read at the first one."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]
                 ) -> None:
        self._model_dir, self._vocab, self._eos = model_dir, vocab_size, eos_token_ids
        self._tokenizer: Any = None

    def matcher(self, grammar: str) -> tuple[Any, str | None]:
        """(a matcher at the start of `grammar`, None), or (None, why there is none)."""
        try:
            import llguidance
        except ImportError:
            return None, ("structured outputs need the `llguidance` package on the attention "
                          "service (pip install llguidance)")
        if self._tokenizer is None:
            path = self._model_dir / "tokenizer.json"
            if not path.is_file():
                return None, f"structured outputs need the model's tokenizer ({path})"
            self._tokenizer = llguidance.LLTokenizer(
                path.read_text("utf-8"), n_vocab=self._vocab, eos_token=list(self._eos))
        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            return None, f"structured outputs: {matcher.get_error()}"
        return matcher, None


def allowed(matchers: list[Any], vocab: int) -> torch.Tensor:
    """The tokens each matcher allows next: bool [S, V] (the bitmasks' words unpacked)."""
    words = torch.frombuffer(bytearray(b"".join(m.compute_bitmask() for m in matchers)),
                             dtype=torch.int32).view(len(matchers), -1)  # [S, ceil(V/32)]
    bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [S, W, 32]
    return bits.reshape(len(matchers), -1)[:, :vocab].bool()
