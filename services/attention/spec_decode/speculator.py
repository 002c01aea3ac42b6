"""The engine's side of speculative decoding: drafts appended to the sequences that may
speculate before the scheduler runs (so a step schedules 1 + k tokens for each, under the
token budget), and after the forward, each one's drafts checked against the target's
greedy tokens (`rejection.verify`) and taken back off."""

from __future__ import annotations

import torch
from prometheus_client import Counter

from common.messages import TokenLogprobs
from services.attention.sampler import GREEDY_BELOW, sampling_probs, token_logprobs
from services.attention.scheduler import ScheduledSeq
from services.attention.sequence import Sequence
from services.attention.spec_decode.config import SpeculativeConfig
from services.attention.spec_decode.ngram import propose
from services.attention.spec_decode.rejection import verify

# vLLM's counters
_DRAFTS = Counter("switchyard:spec_decode_num_drafts", "Sequence steps that carried drafts.")
_DRAFT_TOKENS = Counter("switchyard:spec_decode_num_draft_tokens", "Draft tokens verified.")
_ACCEPTED = Counter("switchyard:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
_ACCEPTED_AT = Counter("switchyard:spec_decode_num_accepted_tokens_per_pos",
                       "Draft tokens accepted, by their position in the draft (0: first).",
                       ["position"])


def speculates(seq: Sequence) -> bool:
    """Whether `seq` may speculate: a request whose distribution at a position depends on
    the logits there and its fixed sampling parameters only (no penalties, biases or
    grammar, no min_tokens still due), and that is decoding (its last token the only one
    not computed)."""
    p = seq.sampling
    return (not p.penalized and not p.biased and seq.matcher is None and not seq.warmup
            and len(seq.output_token_ids) >= p.min_tokens
            and seq.num_computed_tokens == seq.num_tokens - 1)


class Speculator:
    """Drafts by `config` (n-gram lookup) for sequences of at most `max_model_len` tokens."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config, self.max_model_len = config, max_model_len

    def draft(self, running: list[Sequence]) -> dict[Sequence, int]:
        """Append drafts to each running sequence that may speculate; how many each got."""
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return {}
        drafted = {}
        for seq in running:
            if not speculates(seq):
                continue
            room = min(self.config.num_speculative_tokens,
                       seq.sampling.max_tokens - seq.num_output_tokens - 1,
                       self.max_model_len - seq.num_tokens - 1)
            if room < 1:
                continue
            drafts = propose(seq.token_ids, room, self.config.prompt_lookup_min,
                             self.config.prompt_lookup_max)
            if drafts:
                seq.token_ids.extend(drafts)
                drafted[seq] = len(drafts)
        return drafted

    @staticmethod
    def settle(drafted: dict[Sequence, int], scheduled: list[ScheduledSeq]
               ) -> dict[Sequence, int]:
        """The drafts the step runs: those of scheduled sequences within their chunk; the
        rest taken back off (a sequence not scheduled, preempted, or cut by the budget)."""
        steps = {item.seq: item.num_new_tokens for item in scheduled}
        kept = {}
        for seq, k in drafted.items():
            runs = max(0, steps.get(seq, 0) - 1)
            if k > runs:
                del seq.token_ids[len(seq.token_ids) - (k - runs):]
            if runs:
                kept[seq] = runs
        return kept

    @staticmethod
    def accept(seq: Sequence, k: int, logits: torch.Tensor
               ) -> tuple[list[int], list[TokenLogprobs] | None]:
        """The tokens `seq` emits for its `k` drafts, given the target's logits [k + 1, V]
        (float32) at the drafts' positions and the one after: the accepted drafts, then a
        recovered or bonus token (`rejection.verify` over its sampling distribution; a
        seeded request draws from its generator as seeded for this step), with their
        log-probabilities where asked. The drafts are taken off `seq.token_ids`."""
        drafts = seq.token_ids[len(seq.token_ids) - k:]
        del seq.token_ids[len(seq.token_ids) - k:]
        p = seq.sampling
        if p.temperature < GREEDY_BELOW:
            emitted = verify(logits, drafts, None, greedy=True)
        else:
            emitted = verify(sampling_probs(logits, [p] * (k + 1)), drafts, None,
                             greedy=False, generator=seq.next_draw())
        accepted = len(emitted) - 1
        _DRAFTS.inc()
        _DRAFT_TOKENS.inc(k)
        _ACCEPTED.inc(accepted)
        for position in range(accepted):
            _ACCEPTED_AT.labels(str(position)).inc()
        if p.logprobs is None:
            return emitted, None
        return emitted, token_logprobs(logits[:len(emitted)], emitted,
                                       [p.logprobs] * len(emitted))
