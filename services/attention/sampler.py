"""Next-token sampling: penalties, greedy, temperature, top-k, top-p, min-p, log-probabilities.

Every row has its own generator, so a seeded request draws the same tokens whatever else
shares the batch.

`sample()` applies, in order:

- `logit_bias` and `allowed_token_ids`;
- the penalties, the three of OpenAI and vLLM;
- structured outputs' grammar masks;
- the mask of EOS and stop ids below `min_tokens`, unless that would leave no token;
- then temperature, top-k, top-p and min-p, row by row.

It draws with each sequence's own `torch.Generator`. For requests that ask, it returns the
log-probabilities of the raw distribution, with each token's rank. A seeded request's draw
for each token is seeded only by the seed and the token's position (`Sequence.next_draw`), so
a request resubmitted after a failover draws what it would have drawn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.messages import SamplingParams, TokenLogprobs
from services.attention.grammar import allowed
from services.attention.sequence import Sequence

# Temperatures below this are greedy, as in vLLM, because dividing by them overflows float32.
GREEDY_BELOW = 1e-5


def sampling_error(p: SamplingParams, vocab: int) -> str | None:
    """What is wrong with `p` for a vocabulary of `vocab` tokens, by vLLM's ranges, or None.
    The engine refuses such a request alone, because sampling it would fail the whole
    batch."""
    if any(not 0 <= t < vocab for t in p.stop_token_ids):
        return f"stop_token_ids must be in [0, {vocab})"
    if p.logprobs is not None and not 0 <= p.logprobs <= vocab:
        return f"logprobs must be between 0 and {vocab}"
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= vocab:
        return f"prompt_logprobs must be between 0 and {vocab}"
    if not (0 <= p.temperature < math.inf):
        return "temperature must be a finite number, at least 0"
    if not 0 < p.top_p <= 1:
        return "top_p must be in (0, 1]"
    if not 0 <= p.min_p <= 1:
        return "min_p must be in [0, 1]"
    if not (0 < p.repetition_penalty < math.inf):
        return "repetition_penalty must be a finite number above 0"
    if not (-2 <= p.presence_penalty <= 2 and -2 <= p.frequency_penalty <= 2):
        return "presence_penalty and frequency_penalty must be in [-2, 2]"
    if any(not 0 <= t < vocab for t, _ in p.logit_bias) or \
            any(not 0 <= t < vocab for t in p.allowed_token_ids):
        return f"logit_bias and allowed_token_ids take token ids in [0, {vocab})"
    if not all(-100 <= bias <= 100 for _, bias in p.logit_bias):
        return "logit_bias values must be in [-100, 100]"
    return None


@dataclass(frozen=True)
class Sampled:
    """The chosen tokens, and for rows that asked, their log-probabilities."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...] = ()
           ) -> Sampled:
    """One token per row of logits [S, V] (float32); row i is sampled for seqs[i].
    `eos_token_ids` are the model's, used for `min_tokens`."""
    params = [s.sampling for s in seqs]
    raw = logits
    if any(p.biased for p in params):  # before the penalties, as in vLLM
        logits = apply_bias(logits, params)
    if any(p.penalized for p in params):
        logits = _finite(apply_penalties(logits, seqs))
    if any(s.matcher is not None for s in seqs):
        logits = apply_grammars(logits, seqs)
    if any(len(s.output_token_ids) < s.sampling.min_tokens for s in seqs):
        suppressed = suppress_stops(logits, seqs, eos_token_ids)
        # min_tokens yields where it would leave no token, as when allowed_token_ids are
        # all stops
        left = (suppressed > float("-inf")).any(dim=-1, keepdim=True)  # [S, 1]
        logits = torch.where(left, suppressed, logits)
    tokens = logits.argmax(dim=-1)  # [S]
    greedy = [p.temperature < GREEDY_BELOW for p in params]
    if not all(greedy):
        probs = sampling_probs(logits, params)  # [S, V]
        for i, seq in enumerate(seqs):
            if not greedy[i]:
                tokens[i] = torch.multinomial(probs[i], 1, generator=seq.next_draw())[0]
    chosen = tokens.tolist()
    return Sampled(chosen, _logprobs(raw, params, chosen))


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from, [S, V].

    logits: [S, V] float32, with biases, penalties and masks applied. Row i is taken at its
    own temperature, top-k, top-p and min-p. A row that extreme parameters break, leaving no
    finite mass, becomes its argmax's one-hot. That costs its own request its randomness,
    never the batch.
    """
    temps = torch.tensor([max(p.temperature, GREEDY_BELOW) for p in params],
                         dtype=logits.dtype, device=logits.device)
    probs = filtered_probs(_finite(logits / temps[:, None]), params)  # [S, V]
    broken = ~(probs.isfinite().all(dim=-1) & (probs.sum(dim=-1) > 0))
    if broken.any():
        probs[broken] = torch.nn.functional.one_hot(logits[broken].argmax(dim=-1),
                                                    probs.shape[-1]).to(probs.dtype)
    return probs


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Presence and frequency penalties over each sequence's generated tokens, as in
    OpenAI's API, and the repetition penalty over prompt and generated tokens, as in HF and
    vLLM.

    logits: [S, V] float, row i for seqs[i]; returns a penalized copy of the same shape."""
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i, seq in enumerate(seqs):
        p = seq.sampling
        if not p.penalized:
            continue
        row = logits[i]  # [V], a view: edited in place
        if p.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
            seen[torch.tensor(seq.token_ids, device=row.device)] = True
            scaled = torch.where(row > 0, row / p.repetition_penalty,
                                 row * p.repetition_penalty)
            row.copy_(torch.where(seen, scaled, row))
        if p.presence_penalty or p.frequency_penalty:
            counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.int64,
                                                 device=row.device),
                                    minlength=vocab).to(row.dtype)  # [V]
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


def apply_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """OpenAI's `logit_bias` added, and with vLLM's `allowed_token_ids` every other token
    masked out.

    logits: [S, V] float, row i under params[i]; returns a copy of the same shape."""
    logits = logits.clone()
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            allowed = torch.tensor(p.allowed_token_ids, device=logits.device)
            keep = torch.full_like(logits[i], float("-inf"))  # [V]
            keep[allowed] = 0.0
            logits[i] += keep
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
            logits[i, ids] += torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype,
                                           device=logits.device)
    return logits


def apply_grammars(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Structured outputs: tokens a sequence's grammar does not allow next masked out.

    logits: [S, V] float, row i for seqs[i]; returns a copy of the same shape."""
    rows = [i for i, s in enumerate(seqs) if s.matcher is not None]
    ok = allowed([seqs[i].matcher for i in rows], logits.shape[-1], logits.device)  # [R, V]
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(~ok, float("-inf"))
    return logits


def suppress_stops(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: tuple[int, ...]
                   ) -> torch.Tensor:
    """vLLM's min_tokens: a sequence with fewer generated tokens cannot sample its stop
    token ids, nor EOS unless it ignores EOS.

    logits: [S, V] float, row i for seqs[i]; returns a copy with those ids at -inf."""
    logits = logits.clone()
    for i, seq in enumerate(seqs):
        p = seq.sampling
        if len(seq.output_token_ids) < p.min_tokens:
            stops = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
            logits[i, stops] = float("-inf")
    return logits


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after masking tokens outside each row's top-k, top-p nucleus and min-p.

    logits: [S, V] float (temperature applied), row i under params[i]; returns [S, V]
    probabilities of the same dtype, each row summing to 1."""
    vocab = logits.shape[-1]
    device = logits.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                         device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V]
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p, which always holds the first token.
    # top_p 1 keeps all: float32's cumsum reaches 1 before the tail, which would be dropped.
    drop |= ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]) & \
        (top_p[:, None] < 1)
    # min-p: drop tokens less likely than min_p times the most likely one.
    drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives, even where a tiny top_p rounds to 0
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf and +inf -> the largest float, so softmax stays defined."""
    return logits.nan_to_num(nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


def _logprobs(raw: torch.Tensor, params: list[SamplingParams], chosen: list[int]
              ) -> list[TokenLogprobs | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if rows:
        entries = token_logprobs(raw[rows], [chosen[i] for i in rows],
                                 [params[i].logprobs or 0 for i in rows])
        for i, entry in zip(rows, entries, strict=True):
            out[i] = entry
    return out


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]
                   ) -> list[TokenLogprobs]:
    """Row i's log-probability of `token_ids[i]`, that token's rank, and the `num_top[i]`
    likeliest tokens, under the raw distribution of logits [R, V] (float32). The results are
    copied to the host once, not per row."""
    logprobs = logits.log_softmax(dim=-1)  # [R, V]
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    own = logprobs.gather(1, ids[:, None])  # [R, 1]
    ranks = (logprobs > own).sum(dim=-1) + 1  # [R]. NaN compares false, so ranks stay defined
    top_lp, top_ids = logprobs.topk(max(num_top, default=0), dim=-1)  # [R, k]
    own_l, ranks_l, top_lp_l, top_ids_l = (own[:, 0].tolist(), ranks.tolist(),
                                           top_lp.tolist(), top_ids.tolist())
    return [TokenLogprobs(own_l[i], top_ids_l[i][:k], top_lp_l[i][:k], ranks_l[i])
            for i, k in enumerate(num_top)]
