"""How an attention service spreads a step's attention: over its one rank, which holds
every key, or over the DCP group it leads. The builder picks one and hands it to the
engine, which only plans batches through it. The single rank is the group of one."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.messages import DcpPlan, DcpSeqPlan
from dcp.batch import StepBatch, build_rank_batch
from dcp.group import HEARTBEAT_S, DcpGroup, GroupExperts, PartialAttention, StepAborted
from dcp.sharding import ONE_RANK, Sharding
from ep_dispatch.base import ExpertsClient

Attend = Callable[[PartialAttention, int, torch.Tensor, StepBatch], torch.Tensor]


class SingleRank:
    """Attention over this rank's own KV cache: the DCP group of one (`Sharding(1, 1)`)."""

    attend: Attend | None = None  # the model's attention hook; None: its own full one
    heartbeat_s: float | None = None  # how often to `heartbeat` while idle; None: never

    def __init__(self, block_size: int, sliding_window: int | None,
                 sharding: Sharding = ONE_RANK) -> None:
        self.sharding, self._block_size, self._window = sharding, block_size, sliding_window

    def batch(self, seqs: list[DcpSeqPlan], logits_rows: list[int]) -> StepBatch:
        """The step's inputs on the CPU, for the keys rank 0 holds."""
        return build_rank_batch(seqs, 0, self.sharding, self._block_size, self._window,
                                logits_rows)

    def batches(self, plans: list[tuple[list[DcpSeqPlan], list[int]]]) -> list[StepBatch]:
        """A pipelined step's micro-batches, each with its sequences and sampled rows."""
        return [self.batch(seqs, rows) for seqs, rows in plans]

    def mtp_batch(self, seqs: list[DcpSeqPlan], logits_rows: list[int], source: str,
                  rows: list[int]) -> StepBatch:
        """An MTP pass's inputs. A group's peers run it too (`DcpPlan.mtp_source`), from
        rows `rows` of their own copy of its input hidden states."""
        return SingleRank.batch(self, seqs, logits_rows)

    def experts(self, client: ExpertsClient) -> ExpertsClient:
        """The MoE seam the model calls, given the dispatch backend's client."""
        return client

    def in_step_after(self, failure: Exception) -> bool:
        """Whether a step that raised `failure` left no attention peer in a collective
        this rank will never join. A single rank has no peers, so none is left."""
        return True

    def heartbeat(self) -> None:
        """While idle, tell the peers this rank lives, and find out whether they do."""

    def start(self) -> None:
        """Once loaded, wait for the peers to be loaded too. From then on the group's waits
        are bounded."""

    def close(self) -> None:
        pass


class DcpLeader(SingleRank):
    """Rank 0 of a DCP group: each step's plan goes to the peers before its batch is
    built, attention is merged over the group, and MoE outputs are broadcast to them."""

    def __init__(self, group: DcpGroup, sharding: Sharding, block_size: int,
                 sliding_window: int | None, heartbeats: bool = False) -> None:
        super().__init__(block_size, sliding_window, sharding)
        self.group = group
        self.attend = group.attend
        self.heartbeat_s = HEARTBEAT_S if heartbeats else None

    def batch(self, seqs: list[DcpSeqPlan], logits_rows: list[int]) -> StepBatch:
        self.group.send_plan(DcpPlan(seqs))
        return super().batch(seqs, logits_rows)

    def batches(self, plans: list[tuple[list[DcpSeqPlan], list[int]]]) -> list[StepBatch]:
        """One plan for the whole step, with its split. The peers run the same pipeline,
        so the group's collectives come in the same order on every rank."""
        self.group.send_plan(DcpPlan([s for seqs, _ in plans for s in seqs],
                                     micro_batches=[len(seqs) for seqs, _ in plans]))
        return [SingleRank.batch(self, seqs, rows) for seqs, rows in plans]

    def mtp_batch(self, seqs: list[DcpSeqPlan], logits_rows: list[int], source: str,
                  rows: list[int]) -> StepBatch:
        self.group.send_plan(DcpPlan(seqs, mtp_source=source, mtp_rows=rows))
        return SingleRank.batch(self, seqs, logits_rows)

    def experts(self, client: ExpertsClient) -> ExpertsClient:
        return GroupExperts(self.group, client)

    def heartbeat(self) -> None:
        self.group.heartbeat()

    def start(self) -> None:
        self.group.heartbeat()  # the peers answer once loaded

    def in_step_after(self, failure: Exception) -> bool:
        # the peers learn of an expert call's failure (StepAborted) and drop the step too
        return isinstance(failure, StepAborted)

    def close(self) -> None:
        self.group.send_plan(DcpPlan([], stop=True))
        self.group.close()
