"""Structured outputs in the engine: each constrained sequence's llguidance matcher, whose
grammar the gateway built and checked, the tokens it allows at each step, and the tokens it
consumes.

Grammars are compiled once each and kept, so requests with a schema seen before start from a
copy. `prepare` compiles off the event loop, since a complex schema takes a while.

The grammar travels in `SamplingParams.grammar`. The engine keeps a matcher per such
sequence over the model's tokenizer, masks what it does not allow before sampling, and feeds
it each token; a complete grammar ends the sequence.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
MAX_COMPILED = 64  # grammars kept compiled, the least recently used dropped first
# bit k of byte i of a bitmask (u32 words, little-endian) allows token 8 * i + k
_BITS = (1, 2, 4, 8, 16, 32, 64, 128)


class Grammars:
    """Matchers over the model's tokenizer, which is read once, at start-up. What is
    missing for structured outputs, llguidance or a tokenizer.json, is each such request's
    error, never the service's."""

    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]
                 ) -> None:
        self._tokenizer, self._unavailable = _load_tokenizer(model_dir, vocab_size,
                                                              eos_token_ids)
        self._compiled: OrderedDict[str, tuple[Any, str | None]] = OrderedDict()
        self._lock = threading.Lock()  # `prepare` runs in worker threads

    def prepare(self, grammar: str) -> None:
        """Compile `grammar` unless it is compiled already. Any thread may call this."""
        self._compiled_for(grammar)

    def matcher(self, grammar: str) -> tuple[Any, str | None]:
        """(a matcher at the start of `grammar`, None), or (None, why there is none)."""
        template, error = self._compiled_for(grammar)
        return (None, error) if template is None else (template.deep_copy(), None)

    def _compiled_for(self, grammar: str) -> tuple[Any, str | None]:
        with self._lock:
            if (compiled := self._compiled.get(grammar)) is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        compiled = self._compile(grammar)  # unlocked, as it may take a while
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, grammar: str) -> tuple[Any, str | None]:
        if self._tokenizer is None:
            return None, self._unavailable
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, grammar)
        if matcher.is_error():
            return None, f"structured outputs: {matcher.get_error()}"
        return matcher, None


def _load_tokenizer(model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]
                    ) -> tuple[Any, str]:
    """(llguidance's tokenizer, "") or (None, why structured outputs are unavailable)."""
    try:
        import llguidance
    except ImportError:
        return None, ("structured outputs need the `llguidance` package on the attention "
                      "service (pip install llguidance)")
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None, f"structured outputs need the model's tokenizer ({path})"
    try:
        import tokenizers

        text = path.read_text("utf-8")
        size = tokenizers.Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
        # as wide as the logits, or the tokenizer when it has more tokens than the model
        return llguidance.LLTokenizer(text, n_vocab=max(vocab_size, size),
                                      eos_token=list(eos_token_ids) or None), ""
    except Exception as exc:  # a tokenizer llguidance cannot take costs only this feature
        log.warning("structured outputs are unavailable: %s", exc)
        return None, f"structured outputs are unavailable for this model's tokenizer: {exc}"


def allowed(matchers: list[Any], vocab: int, device: torch.device) -> torch.Tensor:
    """The tokens each matcher allows next: bool [S, vocab] on `device`. They are unpacked
    there from the bitmasks' bytes, so only an eighth of the mask's size crosses to a GPU."""
    return _unpack([m.compute_bitmask() for m in matchers], vocab, device)


def allowed_along(matcher: Any, drafts: list[int], vocab: int, device: torch.device
                  ) -> torch.Tensor:
    """The tokens `matcher` allows at each of k drafts' positions and the one after, had
    it consumed the drafts before: bool [k + 1, vocab], for speculation's verify step. The
    matcher is left as it was; the drafts must be ones it accepts (`validate_tokens`)."""
    masks = []
    for token in drafts:
        masks.append(matcher.compute_bitmask())
        matcher.consume_token(token)
    masks.append(matcher.compute_bitmask())
    matcher.rollback(len(drafts))
    return _unpack(masks, vocab, device)


def _unpack(masks: list[bytes], vocab: int, device: torch.device) -> torch.Tensor:
    """Bitmasks, one per row, as bool [S, vocab] on `device`."""
    raw = bytearray(b"".join(masks))
    packed = torch.frombuffer(raw, dtype=torch.uint8).to(device)  # [S * 4 * ceil(n/32)]
    bits = packed[:, None].bitwise_and(torch.tensor(_BITS, dtype=torch.uint8,
                                                    device=device)).ne(0)  # [., 8]
    mask = bits.view(len(masks), -1)  # [S, n]: n, the tokenizer's width, may exceed vocab
    if mask.shape[1] < vocab:  # never built narrower; a token past it is not allowed
        mask = torch.nn.functional.pad(mask, (0, vocab - mask.shape[1]))
    return mask[:, :vocab]
