"""One generation request as the engine tracks it."""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from opentelemetry.trace import SpanContext

from common.messages import FinishReason, SamplingParams, TokenLogprobs

_GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive positions over the seed's bits
_MASK63 = (1 << 63) - 1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Prompt plus generated tokens, and how far the KV cache has computed them.

    `num_computed_tokens` tokens have their KV in the blocks of `block_tables`, computed
    here or found in the prefix cache. The rest of `token_ids` still has to go through the
    model: a prompt, a prompt chunk, or the last sampled token. Preemption by recompute
    resets it to 0 and keeps `token_ids`.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    generator: torch.Generator = field(default_factory=torch.Generator)
    num_computed_tokens: int = 0
    # one table per DCP rank (one without DCP); empty while it holds no block
    block_tables: list[list[int]] = field(default_factory=list)
    cache_salt: str | None = None  # as in vLLM, only requests of the same salt share KV blocks
    span_keys: list[bytes] = field(default_factory=list)  # prefix cache keys of full spans
    num_cached_spans: int = 0  # leading spans of its tables that are in the prefix cache
    # prompt tokens found in the prefix cache when first scheduled; None if not looked up
    num_cached_tokens: int | None = None
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_sent_tokens: int = 0  # output tokens already reported to the client
    # time.monotonic() when the request arrived, was first scheduled, got its first token.
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    trace_parent: SpanContext | None = None  # the gateway's request span, when sampled
    # With `sampling.prompt_logprobs`: entry j for prompt token j, filled as the prompt's
    # chunks run. The first token has none, as nothing precedes it.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=lambda: [None])
    matcher: Any = None  # structured outputs: its llguidance matcher (attention/grammar.py)
    warmup: bool = False  # its rows are routed to every expert (`Engine.add`)
    drafts: list[int] = field(default_factory=list)  # MTP's drafts, for its next step

    def __post_init__(self) -> None:
        # Each sequence draws from its own generator, so its samples do not depend on what
        # else is in the batch; an unseeded request gets a fresh random seed.
        seed = self.sampling.seed
        self.generator.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8)))

    def next_draw(self) -> torch.Generator:
        """The generator to draw this sequence's next token with. A seeded request's is
        seeded only from its seed and that token's position among its outputs, so a
        request resumed elsewhere (`GenerateRequest.resumed`) draws what it would have
        drawn. An unseeded one's goes on with its own random stream."""
        if (seed := self.sampling.seed) is not None:
            self.generator.manual_seed((seed ^ (self.num_output_tokens * _GOLDEN)) & _MASK63)
        return self.generator

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_table(self) -> list[int]:
        """The table of a sequence without DCP, which is rank 0's."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_reusable_tokens(self) -> int:
        """Leading tokens whose KV may come from the prefix cache. That is all but the
        last, whose row must run to sample. While prompt logprobs are scored, it is only the
        positions scored already, since each one's row must run."""
        n = self.num_tokens - 1
        if (self.sampling.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens):
            n = min(n, len(self.prompt_logprobs) - 1)
        return n

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]
