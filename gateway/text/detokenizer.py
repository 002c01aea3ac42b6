"""Incremental detokenization: turn a growing token sequence into text deltas.

Byte-level tokens can split one UTF-8 character across several tokens. Decoders can also
change how a token reads depending on its neighbours, as with SentencePiece's leading
space. So, like vLLM, each step decodes a short window `[prefix_offset:]`. It emits only
what that adds to the already-emitted window `[prefix_offset:read_offset]`. Text is held
back while it ends in an incomplete character, U+FFFD.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gateway.text.tokenizer import Tokenizer

# How many prompt tokens to keep as decoding context for the first generated tokens.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for one sequence's generated tokens.

    Special tokens are skipped unless asked for.
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _pending(self) -> tuple[str, str]:
        """Return (text already emitted for the window, text of the whole window)."""
        assert self._tokenizer is not None
        decode, skip = self._tokenizer.decode, self._skip_special
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], skip)
        full = decode(self._ids[self._prefix_offset:], skip)
        return prefix, full

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens, and return the text that is now certain, which may be ""."""
        if self._tokenizer is None:
            return ""
        pieces = []
        for token_id in token_ids:
            self._ids.append(token_id)
            prefix, full = self._pending()
            if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
                pieces.append(full[len(prefix):])
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return "".join(pieces)

    def flush(self) -> str:
        """Return whatever text is still held back, at the end of the sequence."""
        if self._tokenizer is None:
            return ""
        prefix, full = self._pending()
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix):]
