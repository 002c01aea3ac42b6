"""N-gram drafts (prompt lookup, vLLM's `ngram` method): the sequence's own tokens, prompt
and output, predict its next ones wherever its last few tokens occurred before (code
edits, quotations, summaries repeat their source)."""

from __future__ import annotations


def propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens for a sequence of `token_ids`: its longest suffix of `max_n`
    down to `min_n` tokens that occurred earlier, and the tokens that followed that
    suffix's latest earlier occurrence (the latest: the text nearest in place and topic);
    none where no suffix recurs."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        # an occurrence starting at j < length - n, latest first
        for j in range(length - n - 1, -1, -1):
            if token_ids[j:j + n] == suffix:
                return token_ids[j + n:j + n + k]
    return []
