"""A step's plan: the new tokens of each scheduled sequence, its block tables, and the
rows whose logits are sampled; its `StepBatch` is `dcp.batch.build_rank_batch`'s."""

from __future__ import annotations

from common.messages import DcpSeqPlan
from dcp.batch import StepBatch, build_rank_batch
from dcp.sharding import Sharding
from services.attention.scheduler import ScheduledSeq

SINGLE_RANK = Sharding(1, 1)


def plan_step(scheduled: list[ScheduledSeq], all_logits: bool = False
              ) -> tuple[list[DcpSeqPlan], list[int]]:
    """Each sequence's chunk, and the rows that sample: the last token of each chunk that
    ends its sequence's known tokens, or with `all_logits` every row (prompt scoring)."""
    seqs, rows, first = [], [], 0
    for item in scheduled:
        seq, n = item.seq, item.num_new_tokens
        start = seq.num_computed_tokens
        seqs.append(DcpSeqPlan(seq.token_ids[start:start + n], start, seq.block_tables))
        if all_logits:
            rows.extend(range(first, first + n))
        elif start + n == seq.num_tokens:
            rows.append(first + n - 1)
        first += n
    return seqs, rows


def build_batch(scheduled: list[ScheduledSeq], block_size: int, sliding_window: int | None,
                all_logits: bool = False, sharding: Sharding = SINGLE_RANK) -> StepBatch:
    """Rank 0's batch of the scheduled chunks (a single rank's, by default)."""
    seqs, rows = plan_step(scheduled, all_logits)
    return build_rank_batch(seqs, 0, sharding, block_size, sliding_window, rows)
