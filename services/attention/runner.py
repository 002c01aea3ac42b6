"""The part of an attention service that runs the model over a scheduled step.

It puts the step's inputs on the device and runs them as one batch or as a pipeline of
micro-batches, with CUDA graphs where they fit. It follows the expert seam's step protocol
and computes the logits. This is the `ModelRunner` of nano-vllm and SGLang. The engine,
in `engine.py`, keeps the requests: it decides what to schedule, what to sample, and when
a sequence ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from prometheus_client import Counter

from common import tracing
from common.messages import DcpSeqPlan
from dcp.batch import StepBatch
from dcp.strategy import SingleRank
from ep_dispatch.base import ExpertsClient, Movable, Pipelined
from ep_dispatch.placement import Placement
from services.attention.batch import plan_step
from services.attention.config import AttentionConfig
from services.attention.graphs import DecodeGraphs
from services.attention.kv_cache import KVCache
from services.attention.micro_batches import MicroBatchTuner, micro_batch_count, split
from services.attention.model import DenseModel
from services.attention.scheduler import ScheduledSeq
from services.attention.spec_decode.mtp import MtpWeights, mtp_block
from services.attention.timeline import StepTimeline
from services.attention.warmup import warmup_routing
from services.model.config import ModelConfig
from services.model.layers import rms_norm

# Divided by engine_step_seconds_count, this gives the mean micro-batches per step. That
# is 1 where no step is pipelined.
_MICRO_BATCHES = Counter("switchyard:micro_batches", "Micro-batches the engine's forward "
                         "passes ran as (one per step that is not pipelined).")


@dataclass(frozen=True)
class Forward:
    """A step's forward pass.

    `hidden` holds the hidden states [T, H] (float, the model's dtype) of every scheduled
    token in order. `logits_rows` [S] (int64) are the rows of them that sample.
    """

    hidden: torch.Tensor
    logits_rows: torch.Tensor


class ModelRunner:
    """Runs `model` over the KV cache `kv`.

    The MoE layers run through `experts`. `attention` spreads the attention, over one rank
    or over a DCP group that this rank leads. Decode steps are replayed from `graphs`
    where captured.

    `warmup_replicas` is the largest number of replicas of one expert. A warm-up's forced
    routing covers that many, and it changes when a rebalance switches the placement.
    `moe_layers` are the layers whose experts the expert ranks hold.
    """

    def __init__(self, config: AttentionConfig, model_config: ModelConfig, device: str,
                 model: DenseModel, kv: KVCache, experts: ExpertsClient,
                 attention: SingleRank, graphs: DecodeGraphs | None,
                 warmup_replicas: int, moe_layers: list[int]) -> None:
        self.config, self.model_config, self.device = config, model_config, device
        self.model, self.kv, self.experts = model, kv, experts
        self.attention, self.graphs = attention, graphs
        self.warmup_replicas = warmup_replicas
        # the layers the expert ranks serve, from `ModelConfig.served_moe_layers`
        self.moe_layers = moe_layers
        self.tuner = MicroBatchTuner(torch.device(device).type,
                                     len(model_config.moe_layer_ids))
        self.last_timeline: StepTimeline | None = None  # of the last pipelined step

    def close(self) -> None:
        """Leave the experts and the DCP group."""
        self.experts.close()
        self.attention.close()

    def run(self, scheduled: list[ScheduledSeq]) -> Forward | None:
        """Run the forward pass of a step. Returns None where it ran nothing.

        With an empty step, this rank joins the other ranks' exchanges, which is a lockstep
        backend's idle step.
        """
        count = self._micro_batches(scheduled)
        groups = split(scheduled, count) if scheduled else []
        tokens = sum(item.num_new_tokens for item in scheduled)
        # A lockstep backend's ranks agree on the step's rounds, which is the largest
        # number of micro-batches.
        if not self.experts.begin_step(tokens, max(1, len(groups))):
            return None
        if not scheduled:  # other ranks have work, so join their exchanges with zero rows
            self.experts.idle_step()
            return None
        start = time.monotonic()
        forward = self._forward(scheduled, groups)
        self.tuner.observe(count, tokens, len(scheduled), time.monotonic() - start)
        self.model.publish_load()  # for stats(), which must not wait on the device
        return forward

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, V] of hidden states [N, H]."""
        return self.model.logits(hidden)

    def mtp_pass(self, w: MtpWeights, plans: list[DcpSeqPlan], source: torch.Tensor,
                 rows: list[int], logits_rows: list[int], kind: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a pass of the MTP layer `w`, for `spec_decode.mtp.MtpRunner.mtp_pass`.

        The pass runs over `plans`, from rows `rows` of `source` [N, H]. With `kind`
        "step", `source` is the step's hidden states. With "pass", it is the last pass's
        output. A DCP group's peers are told first. Returns the output y [T, H], and
        float32 logits [len(logits_rows), V].
        """
        batch = self.attention.mtp_batch(plans, logits_rows, kind, rows).to(self.device)
        self.experts.begin_step(batch.input_ids.shape[0])
        index = torch.tensor(rows, dtype=torch.int64, device=source.device)
        y = mtp_block(self.model, w, batch, source[index], self.kv, self.experts)
        normed = rms_norm(y[batch.logits_rows], w.head_norm, self.model_config.rms_norm_eps)
        return y, self.logits(normed)

    def score(self, scheduled: ScheduledSeq) -> torch.Tensor:
        """Float32 logits [n, V] at every new position of one sequence's chunk, in one
        batch. This is for prompt scoring."""
        self.experts.begin_step(scheduled.num_new_tokens)
        batch = self.batch([scheduled], all_logits=True)
        return self.logits(self.model.forward(batch, self.kv, self.experts))

    def batch(self, scheduled: list[ScheduledSeq], all_logits: bool = False) -> StepBatch:
        """The step's inputs, on the device. A DCP leader's peers get the plan first."""
        batch = self.attention.batch(*plan_step(scheduled, all_logits))
        if any(item.seq.warmup for item in scheduled):
            batch = replace(batch, forced_routing=warmup_routing(
                scheduled, self.model_config, self.warmup_replicas))
        return batch.to(self.device)

    def movable(self) -> Movable:
        """The experts client, if its experts can move while serving.

        Raises ValueError otherwise.
        """
        if not isinstance(self.experts, Movable):
            raise ValueError(f"moving experts while serving needs the rpc dispatch backend, "
                             f"not {self.config.dispatch_backend}")
        return self.experts

    def switch_placement(self, version: int) -> Placement:
        """Lay the calls out by prepared placement `version` from the next step on."""
        placement = self.movable().switch(version)
        self.warmup_replicas = placement.max_replicas
        return placement

    def _forward(self, scheduled: list[ScheduledSeq], groups: list[list[ScheduledSeq]]
                 ) -> Forward:
        """Run the step in one batch, or as a pipeline of the micro-batches `groups`.

        The pipeline is used where the experts' backend overlaps its exchanges with this
        rank's computation. `groups` come from `micro_batches.split`. A pipelined step's
        timeline is kept as `last_timeline`, and drawn in the step's span.
        """
        _MICRO_BATCHES.inc(len(groups))
        if len(groups) == 1:
            batch = self.batch(scheduled)
            if self.graphs and batch.forced_routing is None and self.graphs.fits(batch):
                return Forward(self.graphs.forward(batch), batch.logits_rows)
            return Forward(self.model.forward(batch, self.kv, self.experts),
                           batch.logits_rows)
        batches = [b.to(self.device) for b in self.attention.batches(
            [plan_step(g) for g in groups])]  # a DCP group's peers get one plan
        assert isinstance(self.experts, Pipelined)  # `_micro_batches` split it, so it overlaps
        self.last_timeline = StepTimeline()
        hidden = self.model.forward_pipelined(batches, self.kv, self.experts.start,
                                              self.last_timeline)
        if tracing.detailed():
            self.last_timeline.draw()
        rows = torch.tensor(plan_step(scheduled)[1], dtype=torch.int64, device=self.device)
        return Forward(torch.cat(hidden), rows)

    def _micro_batches(self, scheduled: list[ScheduledSeq]) -> int:
        """How many micro-batches this step asks for.

        The count is `--micro-batches` where the backend overlaps and no warm-up forces
        its routing. The backends that overlap are `rpc`, and `torch` over
        torch.distributed. A DCP group's peers run the leader's split. With `auto`, the
        tuner measures the count. Otherwise the count is 1.
        """
        experts = self.experts
        overlaps = isinstance(experts, Pipelined) and experts.overlaps \
            and not any(item.seq.warmup for item in scheduled)
        count = micro_batch_count(self.config.micro_batches, overlaps)
        if count is not None or not scheduled:
            return count or 1
        assert isinstance(experts, Pipelined)  # it overlaps
        return self.tuner.choose(sum(item.num_new_tokens for item in scheduled),
                                 len(scheduled), experts.round_trip_s())
