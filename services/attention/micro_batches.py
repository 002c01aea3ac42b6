"""How a step splits into micro-batches for the ping-pong pipeline with the expert
services (`DenseModel.forward_pipelined`): how many, and which sequences each takes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the flags read this module; `serve` and the gateway never load torch
    from services.attention.scheduler import ScheduledSeq

# `--micro-batches auto` pipelines steps of at least this many tokens on a GPU (SGLang's
# two-batch overlap starts to pay at about 64 tokens per device; not measured here).
PIPELINE_MIN_TOKENS = 64


def micro_batch_count(setting: str, num_tokens: int, overlaps: bool, device: str) -> int:
    """Micro-batches for a step of `num_tokens`: `setting` (auto, 1, 2, 3), where the
    experts' backend `overlaps` exchanges with computation (else 1: nothing to hide).

    `auto` is 1 on the CPU: there the attention and expert services share the host's
    cores and memory bus, so while one side computes the other has nothing to run on
    (measured on 2 cores: 0.77-0.96x the tokens/s of one batch a step at concurrency 16
    and 64, docs/benchmarks.md); 2 from `PIPELINE_MIN_TOKENS` on a GPU."""
    if not overlaps:
        return 1
    if setting == "auto":
        return 2 if device != "cpu" and num_tokens >= PIPELINE_MIN_TOKENS else 1
    return int(setting)


def split(scheduled: list[ScheduledSeq], parts: int) -> list[list[ScheduledSeq]]:
    """`scheduled` in at most `parts` contiguous groups of about equal tokens, none empty,
    in order (so their hidden states, concatenated, are the whole step's)."""
    total = sum(item.num_new_tokens for item in scheduled)
    groups: list[list[ScheduledSeq]] = [[]]
    done = 0
    for item in scheduled:
        # start the next group once this one holds its share of the tokens
        if groups[-1] and len(groups) < parts and done >= total * len(groups) / parts:
            groups.append([])
        groups[-1].append(item)
        done += item.num_new_tokens
    return groups
