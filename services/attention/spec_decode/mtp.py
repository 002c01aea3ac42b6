"""DeepSeek's multi-token prediction as the drafter, as in the DeepSeek-V3 report §2.2 and
vLLM's `deepseek_mtp`.

The checkpoint's MTP layer (`model.layers.{num_layers}.*`) predicts the token after next.
At position p it reads the target's final hidden state h_p and the embedding of token
p + 1, and runs one decoder block of its own: MLA, and a MoE whose experts live on the
expert ranks like any layer's. The shared head then gives logits for token p + 2:

    x_p = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])      (embed zeroed at p = 0)
    y_p = block(x_p)                                         (its KV at position p)
    logits_p = lm_head(shared_head.norm(y_p))

Its attention has KV of its own, one more layer of the paged cache over the same blocks.
So after each step it runs over every position the step settled, in `MtpProposer.propose`'s
first pass. These are a prompt chunk's positions, or a decode's verified tokens, whose next
tokens are now known. The last one gives the first draft. Each further draft runs the block
again on its own output and the draft before, at positions the next step computes anyway.
Their blocks are taken early where free, so a draft never pushes another sequence out.

`ModelConfig.from_dir` finds the layer where its weights are (`mtp_layers`). Its KV covers
MLA's latent rows too. Where no block is free for a further draft's positions it drafts
fewer. Drafts are greedy, with q one-hot, so verification is the n-gram path's.

The block's MoE is an MoE layer like any other. On every backend but `deepep`
(`Backend.mtp`), `ModelConfig.served_moe_layers` adds it to the layers the expert ranks
hold, so it is placed, rebalanced and counted per expert as the decoder's are. On a lockstep
backend an MTP pass is a round of its own (`ep_dispatch.torch_dist`). `deepep`'s rounds take
the decoder's layers only, so there MTP is refused at start-up; n-gram works. In a DCP group
each pass is a plan of its own (`DcpPlan.mtp_source`). Every rank holds the step's hidden
states and the last pass's output and runs the block over its shard of the MTP's KV, and
the group merges its attention as any layer's. With CUDA graphs a verify step is captured as
any decode step: its 1 + k rows a sequence are decode rows, each over its own keys, within
`--cuda-graph-max-batch` rows. The MTP passes run eagerly. That is shown on the CPU with
`graphs.eager_capture`, and has not run on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch

from common.messages import DcpSeqPlan
from dcp.batch import StepBatch
from ep_dispatch.base import ExpertsClient
from moe_kernels.selection import linear
from services.attention.block_manager import BlockManager
from services.attention.kv_cache import KVCache
from services.attention.model import (
    DenseModel,
    LayerWeights,
    Weight,
    in_panels,
    load_layer,
    shared_experts,
)
from services.attention.router import route
from services.attention.sequence import Sequence
from services.attention.weights import WeightReader
from services.model.config import CheckpointError, ModelConfig
from services.model.layers import rms_norm, rope_cos_sin


@dataclass(frozen=True)
class MtpWeights:
    """The MTP layer's own weights. Its embedding and head are the model's; DeepSeek's
    checkpoints repeat them as `embed_tokens` and `shared_head.head`."""

    layer: int  # its index in the checkpoint: num_layers
    enorm: torch.Tensor  # [H], on the next token's embedding
    hnorm: torch.Tensor  # [H], on the previous hidden state
    eh_proj: Weight  # [H, 2H]: [enorm(e), hnorm(h)] -> the block's input
    block: LayerWeights  # its decoder block: attention and a MoE layer
    head_norm: torch.Tensor  # [H], shared_head.norm, before the model's lm_head


def load_mtp(read: WeightReader, cfg: ModelConfig) -> MtpWeights:
    """The first MTP layer of `ckpt`. Raises a CheckpointError naming what is missing."""
    if not cfg.mtp_layers:
        raise CheckpointError("the mtp method drafts with the checkpoint's multi-token-"
                              "prediction layer; this checkpoint has none (model.layers."
                              f"{cfg.num_layers}.eh_proj.weight)")
    i, h = cfg.num_layers, cfg.hidden_size

    p = f"model.layers.{i}"
    return MtpWeights(i, read.get(f"{p}.enorm.weight", h), read.get(f"{p}.hnorm.weight", h),
                      read.linear((f"{p}.eh_proj.weight", h, 2 * h)), load_layer(read, cfg, i),
                      read.get(f"{p}.shared_head.norm.weight", h))


@dataclass(frozen=True)
class Settled:
    """One sequence's positions a step settled: `count` positions from `start`, whose
    target hidden states are rows [row, row + count) of the step's, and whose next
    tokens are in `seq.token_ids` now."""

    seq: Sequence
    start: int
    row: int
    count: int


class MtpRunner(Protocol):
    """What runs an MTP pass: the model runner (`ModelRunner.mtp_pass`)."""

    def mtp_pass(self, w: MtpWeights, plans: list[DcpSeqPlan], source: torch.Tensor,
                 rows: list[int], logits_rows: list[int], kind: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP block over `plans`, whose tokens are each position's next token.

        It reads rows `rows` of `source` [N, H]: the step's hidden states when `kind` is
        "step", or the last pass's output when it is "pass". Returns its output y [T, H]
        and the float32 logits [len(logits_rows), V] at `logits_rows`.
        """
        ...


class MtpProposer:
    """Runs the MTP layer `weights` through `runner` after each step; a sequence's
    drafts for the next step are left in `seq.drafts`."""

    def __init__(self, weights: MtpWeights, runner: MtpRunner,
                 block_manager: BlockManager) -> None:
        self.w, self.runner, self.blocks = weights, runner, block_manager

    @torch.inference_mode()
    def propose(self, settled: list[Settled], hidden: torch.Tensor,
                rooms: dict[Sequence, int]) -> None:
        """`settled` holds the step's positions per sequence, and hidden [T, H] the step's
        target hidden states. `rooms` maps the sequences to draft for to the most drafts
        each may take next step."""
        plans = [DcpSeqPlan(s.seq.token_ids[s.start + 1:s.start + s.count + 1], s.start,
                            s.seq.block_tables) for s in settled]
        rows = [s.row + i for s in settled for i in range(s.count)]
        ends = list(accumulate(s.count for s in settled))
        drafting = [j for j, s in enumerate(settled) if s.seq in rooms]
        lasts = [ends[j] - 1 for j in drafting]  # rows of y whose logits draft
        y, logits = self._pass(plans, hidden, rows, lasts, "step")
        seqs = [settled[j].seq for j in drafting]
        for depth in range(max((rooms[s] for s in seqs), default=0)):
            tokens = logits.argmax(-1).tolist()  # greedy drafts: q is one-hot
            going = []
            for j, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
                seq.drafts.append(token)
                if depth + 1 < rooms[seq] and self._room_for(seq, depth + 1):
                    going.append(j)
            if not going:
                return
            seqs = [seqs[j] for j in going]
            # the draft before, at its position, counting from the last token's
            # (num_tokens - 1)
            plans = [DcpSeqPlan([seq.drafts[-1]], seq.num_tokens - 1 + depth,
                                seq.block_tables) for seq in seqs]
            y, logits = self._pass(plans, y, [lasts[j] for j in going],
                                   list(range(len(seqs))), "pass")
            lasts = list(range(len(seqs)))

    def _room_for(self, seq: Sequence, more: int) -> bool:
        """Whether `seq` holds, or can take now, blocks for `more` positions past its
        computed ones, for a further draft's KV. If it can, it takes them."""
        if not self.blocks.can_allocate(seq, more):
            return False
        self.blocks.allocate(seq, more)
        return True

    def _pass(self, plans: list[DcpSeqPlan], source: torch.Tensor, rows: list[int],
              logits_rows: list[int], kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.mtp_pass(self.w, plans, source, rows, logits_rows, kind)


def mtp_block(model: DenseModel, w: MtpWeights, batch: StepBatch, hidden: torch.Tensor,
              kv: KVCache, experts: ExpertsClient) -> torch.Tensor:
    """The MTP layer over `batch`, whose input ids are each position's next token, from
    hidden [T, H] at those positions: the target's, or the pass before's. Returns its
    output y [T, H], before the shared head's norm. Its KV is written at the batch's
    slots."""
    cfg, eps, blk = model.cfg, model.cfg.rms_norm_eps, w.block
    cos, sin = rope_cos_sin(batch.positions, cfg.rope_dim, cfg.rope_theta, model.dtype,
                            cfg.rope)
    e = model.embed[batch.input_ids].masked_fill((batch.positions == 0)[:, None], 0)
    x = linear(torch.cat([rms_norm(e, w.enorm, eps), rms_norm(hidden, w.hnorm, eps)], -1),
               w.eh_proj)  # [T, H]
    compiled = model.compiled_block(x, batch) if in_panels(blk) else None  # on decode rows
    h, x = model.attention_block(w.layer, blk, x, cos, sin, batch, kv, compiled)
    assert blk.gate is not None  # an MTP block's MLP is a MoE (`load_layer`)
    ids, weights = route(x, blk.gate, cfg.routing_spec, blk.gate_bias)  # [T, K] each
    model.count_load(w.layer, ids)
    routed = experts(w.layer, x, ids, weights)
    shared = shared_experts(blk, x)
    return h + (routed if shared is None else routed + shared)
