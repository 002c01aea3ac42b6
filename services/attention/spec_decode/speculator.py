"""The engine's side of speculative decoding.

Before the scheduler runs, drafts are appended to the sequences that may speculate, so a
step schedules 1 + k tokens for each under the token budget. After the forward, each
sequence's drafts are verified (`rejection.verify`) and taken back off. MTP's drafts are
made after a step, for the next one (`mtp.py`).
"""

from __future__ import annotations

import torch
from prometheus_client import Counter

from common.messages import TokenLogprobs
from services.attention.grammar import allowed_along
from services.attention.sampler import GREEDY_BELOW, sampling_probs, token_logprobs
from services.attention.scheduler import ScheduledSeq
from services.attention.sequence import Sequence
from services.attention.spec_decode.config import SpeculativeConfig
from services.attention.spec_decode.mtp import MtpProposer, Settled
from services.attention.spec_decode.ngram import propose
from services.attention.spec_decode.rejection import verify

# vLLM's counters
_DRAFTS = Counter("switchyard:spec_decode_num_drafts", "Sequence steps that carried drafts.")
_DRAFT_TOKENS = Counter("switchyard:spec_decode_num_draft_tokens", "Draft tokens verified.")
_ACCEPTED = Counter("switchyard:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
_ACCEPTED_AT = Counter("switchyard:spec_decode_num_accepted_tokens_per_pos",
                       "Draft tokens accepted, by their position in the draft (0: first).",
                       ["position"])


def may_speculate(seq: Sequence) -> bool:
    """Whether `seq`'s distribution at a position depends only on the logits there, its
    fixed sampling parameters and its grammar. That rules out penalties and biases, which
    depend on the tokens before in other ways."""
    p = seq.sampling
    return not p.penalized and not p.biased and not seq.warmup


def speculates(seq: Sequence) -> bool:
    """Whether `seq` speculates now: it may (`may_speculate`), no min_tokens are still
    due, and it is decoding, with its last token the only one not computed."""
    return (may_speculate(seq) and len(seq.output_token_ids) >= seq.sampling.min_tokens
            and seq.num_computed_tokens == seq.num_tokens - 1)


class Speculator:
    """Drafts by `config` for sequences of at most `max_model_len` tokens, by n-gram
    lookup or by the MTP layer through `mtp`. MTP's drafts are made after each step, in
    `after_step`."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 mtp: MtpProposer | None = None) -> None:
        self.config, self.max_model_len, self.mtp = config, max_model_len, mtp

    def active(self, num_running: int) -> bool:
        """Whether a step of `num_running` sequences speculates (`disable_by_batch_size`)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def room(self, seq: Sequence) -> int:
        """The most drafts `seq` may take, as its max_tokens and the context allow."""
        return min(self.config.num_speculative_tokens,
                   seq.sampling.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens - 1)

    def draft(self, running: list[Sequence]) -> dict[Sequence, int]:
        """Append drafts to each running sequence that may speculate. Returns how many
        each got."""
        active, drafted = self.active(len(running)), {}
        for seq in running:
            pending, seq.drafts = seq.drafts, []  # MTP's drafts, made for this step only
            if not active or not speculates(seq) or (room := self.room(seq)) < 1:
                continue
            drafts = pending[:room] if self.mtp else propose(
                seq.token_ids, room, self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            if drafts and seq.matcher is not None:  # cut at the first the grammar forbids
                drafts = drafts[:seq.matcher.validate_tokens(drafts)]
            if drafts:
                seq.token_ids.extend(drafts)
                drafted[seq] = len(drafts)
        return drafted

    def after_step(self, settled: list[Settled], hidden: torch.Tensor,
                   num_running: int) -> None:
        """For MTP, compute its KV over the positions the step settled, for sequences that
        may speculate, and drafts for the next step for those that will (`MtpProposer`)."""
        if self.mtp is None or not self.active(num_running):
            return
        settled = [s for s in settled if may_speculate(s.seq) and s.seq.finish_reason is None]
        if settled:
            rooms = {s.seq: room for s in settled
                     if speculates(s.seq) and (room := self.room(s.seq)) >= 1}
            self.mtp.propose(settled, hidden, rooms)

    @staticmethod
    def settle(drafted: dict[Sequence, int], scheduled: list[ScheduledSeq]
               ) -> dict[Sequence, int]:
        """The drafts the step runs: those of scheduled sequences, within their chunk. The
        rest are taken back off, for a sequence not scheduled, preempted, or cut by the
        budget."""
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
        """The tokens `seq` emits for its `k` drafts, with their log-probabilities where
        asked.

        `logits` [k + 1, V] (float32) are the target's at the drafts' positions and the one
        after. The tokens are the accepted drafts, then a recovered or bonus token.
        `rejection.verify` runs over the sequence's sampling distribution, with its
        grammar's mask at each position applied. A seeded request draws from its generator
        as seeded for this step. The drafts are taken off `seq.token_ids`.
        """
        drafts = seq.token_ids[len(seq.token_ids) - k:]
        del seq.token_ids[len(seq.token_ids) - k:]
        p = seq.sampling
        target = logits if seq.matcher is None else logits.masked_fill(
            ~allowed_along(seq.matcher, drafts, logits.shape[-1], logits.device), float("-inf"))
        if p.temperature < GREEDY_BELOW:
            emitted = verify(target, drafts, None, greedy=True)
        else:
            emitted = verify(sampling_probs(target, [p] * (k + 1)), drafts, None,
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
