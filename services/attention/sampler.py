"""Next-token sampling: greedy, temperature, top-k, top-p, each row with its own generator."""

from __future__ import annotations

import torch

from services.attention.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """One token per row of logits [S, V] (float32), row i sampled for seqs[i].

    Filters are row-wise and every draw uses the sequence's own generator, so a seeded
    request gets the same tokens whatever else shares the batch.
    """
    params = [s.sampling for s in seqs]
    greedy = torch.tensor([p.temperature == 0.0 for p in params])
    tokens = logits.argmax(dim=-1)  # [S]
    if greedy.all():
        return tokens.tolist()
    temps = torch.tensor([p.temperature or 1.0 for p in params], dtype=logits.dtype)
    probs = _filtered_probs(logits / temps[:, None], params)  # [S, V]
    for i, seq in enumerate(seqs):
        if not greedy[i]:
            tokens[i] = torch.multinomial(probs[i], 1, generator=seq.generator)[0]
    return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Softmax after masking tokens outside each row's top-k and top-p nucleus."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    ranks = torch.arange(vocab)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always the first token).
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)
