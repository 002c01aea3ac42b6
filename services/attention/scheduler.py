"""Continuous batching with chunked prefill and preemption by recompute.

Every step, running sequences go first, oldest first. Each gets one decode token, or its
next prefill chunk. Then waiting sequences are admitted while the token budget, the
sequence limit and the free KV blocks allow. With prefix caching, an admitted sequence
first takes the blocks of its longest cached prefix and computes only the rest.

A sequence that cannot get a block preempts the newest running one. The preempted
sequence's KV is dropped, and recomputed when it is admitted again. Whatever part of it is
still cached then is found like any cached prefix.

The token budget is `--max-num-batched-tokens`. The sequence limit is `--max-num-seqs`,
capped at the token budget, so every running sequence decodes every step. Each sequence
tracks `num_computed_tokens`. A prompt longer than the budget is prefilled in chunks over
several steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.attention.block_manager import BlockManager
from services.attention.sequence import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledSeq:
    """`num_new_tokens` tokens of `seq` to run this step, from `seq.num_computed_tokens` on."""

    seq: Sequence
    num_new_tokens: int


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("--max-num-batched-tokens and --max-num-seqs must be at least 1")
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        # No more sequences run than the budget has tokens, so each decodes every step.
        # Beyond that, the newest would wait for older ones to finish.
        self.max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running.pop()  # the newest, never one already scheduled this step
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, n)
                scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        # Admitting while preempting would only thrash. Wait for blocks to come back.
        while not preempted and self.waiting and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            seq = self.waiting[0]
            cached = self.block_manager.lookup(seq)
            n = min(seq.num_tokens - cached.num_tokens, budget)
            if not self.block_manager.can_allocate(seq, n, cached):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.block_manager.allocate(seq, n, cached)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Retire a finished or aborted sequence wherever it is, and return its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        self.block_manager.free(seq)
