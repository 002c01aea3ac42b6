"""A step's plan: the new tokens of each scheduled sequence, its block tables, and the
rows whose logits are sampled. Its `StepBatch` is the one `dcp.batch.build_rank_batch`
builds for a single rank, with `Sharding(1, 1)`.

The attention strategy's `batch()`, in `dcp.strategy`, is built on
`dcp.batch.build_rank_batch`. It flattens the step's tokens `[T]`, positions, KV slots to
write, and attention metadata. A DCP leader first sends its peers the plan. Decodes and the
short chunks of speculation's verify steps are attended as one padded batch, a row each over
the keys up to its position. Prefill chunks are attended one by one.
"""

from __future__ import annotations

from common.messages import DcpSeqPlan
from services.attention.scheduler import ScheduledSeq


def plan_step(scheduled: list[ScheduledSeq], all_logits: bool = False
              ) -> tuple[list[DcpSeqPlan], list[int]]:
    """Each sequence's chunk, and the rows that sample.

    The sampled rows are the last token of each chunk that ends its sequence's known tokens.
    With `all_logits`, used for prompt scoring, every row samples.
    """
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
