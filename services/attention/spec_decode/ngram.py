"""N-gram drafts, or prompt lookup, as in vLLM's `ngram` method.

The sequence's own tokens, prompt and output, predict its next ones wherever its last few
tokens occurred before. Code edits, quotations and summaries repeat their source.
"""

from __future__ import annotations

import torch


def propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens for a sequence of `token_ids`.

    It finds the longest suffix, of `max_n` down to `min_n` tokens, that occurred earlier,
    and drafts the tokens that followed that suffix's latest earlier occurrence. The latest
    is the text nearest in place and topic. There are no drafts where no suffix recurs.
    Each length takes one vectorised pass, because a Python scan of a long sequence cost
    more than the step it drafts for.
    """
    length = len(token_ids)
    if length < 2:
        return []
    tokens = torch.tensor(token_ids, dtype=torch.int64)  # [L]
    # where the last token occurred before: every longer match ends at one of these
    ends = (tokens[:-1] == tokens[-1]).nonzero().flatten()  # [M]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        starts = ends - (n - 1)
        starts = starts[starts >= 0]
        if not starts.numel():
            continue
        windows = tokens[:-1].unfold(0, n, 1)[starts]  # [M', n]: n tokens from each start
        hits = starts[(windows == tokens[length - n:]).all(dim=1)]
        if hits.numel():
            after = int(hits[-1]) + n
            return token_ids[after:after + k]
    return []
