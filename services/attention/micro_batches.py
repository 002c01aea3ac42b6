"""How a step splits into micro-batches for the ping-pong pipeline with the expert
services (`DenseModel.forward_pipelined`): how many, as asked or as measured by
`MicroBatchTuner`, and which sequences each takes.

`--micro-batches 2` or `3` splits a step into contiguous groups of sequences, run as a
ping-pong pipeline. It works with `rpc`, and with `torch` over torch.distributed. Each
group's layers are a generator that stops at each MoE layer with its call. The driver starts
that exchange with `RpcExperts.start`, which sends the rows and returns an `RpcExchange` that
also carries the failover. The driver runs the next group's layers while the experts
compute, then finishes the exchanges in the order they started. Every float32 linear runs
the panel kernel, whose sums per row do not depend on the other rows, so a split step's
logits are the whole step's bit for bit. The driver records when each micro-batch computed
and when each of its calls was out (`timeline.py`).

`auto` measures, with `MicroBatchTuner`. It tries pipelining where the wire's round trips are
at least a tenth of a one-batch step, or from 64 tokens on a GPU. Each answer says how long
the expert rank held it (`ExpertResult.held_s`), and the caller takes that off the call's
time. The tuner times 1, 2 and 3 micro-batches over a few steps of each size of step, keeps
the fastest and logs it, and measures again every 2000 steps of that size. On loopback on
the CPU the wire is a few percent of a step, and the step stays one batch.

The `torch` backend's lockstep ranks agree on each step's rounds (`ep_dispatch.torch_dist`).
A DCP group's leader sends its peers one plan with the split (`DcpPlan.micro_batches`) and
every rank runs the same pipeline, so the group's attention merges and the MoE outputs'
broadcasts (`GroupExchange.finish`) come in the same order on every rank. With `nccl` the
host never waits on an exchange (`ep_dispatch.nccl`); this has not yet run on a GPU.
`deepep` does not split yet.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the flags read this module; `serve` and the gateway never load torch
    from services.attention.scheduler import ScheduledSeq

# `--micro-batches auto` tries pipelining steps of at least this many tokens on a GPU.
# SGLang's two-batch overlap starts to pay at about 64 tokens per device; this is not
# measured here. It also tries on any device where the wire's round trips are at least
# `WIRE_SHARE` of a step. On 2 cores at 0 ms, pipelining measured 0.77-0.96x the tokens/s of
# one batch a step (docs/benchmarks.md); there both sides share the cores and there is no
# wire to hide.
PIPELINE_MIN_TOKENS = 64
WIRE_SHARE = 0.1
CANDIDATES = (1, 2, 3)
PROBE_STEPS = 4  # steps timed per candidate count; their median per token is compared
REPROBE_STEPS = 2000  # steps of one size before its choice is measured again
log = logging.getLogger("switchyard.micro_batches")


def micro_batch_count(setting: str, overlaps: bool) -> int | None:
    """Micro-batches a step takes by `setting` (auto, 1, 2, 3). That holds where the
    experts' backend `overlaps` exchanges with computation; otherwise it is 1, as there is
    nothing to hide. None means `auto`, which `MicroBatchTuner` decides."""
    if not overlaps:
        return 1
    return None if setting == "auto" else int(setting)


@dataclass
class _Size:
    """One size of step's probe: seconds per token of each candidate count's steps."""

    timed: dict[int, list[float]] = field(default_factory=dict)
    chosen: int | None = None
    steps: int = 0  # since chosen


class MicroBatchTuner:
    """`--micro-batches auto`.

    For each size of step, it finds whether the wire is worth hiding, and if so which count
    of `CANDIDATES` runs fastest, timed over `PROBE_STEPS` steps each. It chooses again
    every `REPROBE_STEPS` steps of that size. A size of step is its tokens to the power of
    two, and its sequences up to 3. Whether the wire is worth hiding compares the backend's
    measured round trip, times `moe_layers`, with a one-batch step's time.

    A pipeline's worth depends on more than the round trip. It also depends on the experts'
    compute per micro-batch, which grows with micro-batches when reading their weights
    bounds it, and on whether both sides share the cores. So the choice is the measured step
    time, and the round trip only says whether to try.
    """

    def __init__(self, device: str, moe_layers: int) -> None:
        self.device, self.moe_layers = device, moe_layers
        self._sizes: dict[tuple[int, int], _Size] = {}

    @staticmethod
    def _key(num_tokens: int, num_seqs: int) -> tuple[int, int]:
        return num_tokens.bit_length(), min(num_seqs, max(CANDIDATES))

    def choose(self, num_tokens: int, num_seqs: int, round_trip_s: float | None) -> int:
        """This step's count. `round_trip_s` is the exchange's measured wire round trip, or
        None where the backend does not measure it."""
        key = self._key(num_tokens, num_seqs)
        if key[1] == 1:
            return 1  # nothing to split
        size = self._sizes.setdefault(key, _Size())
        if size.chosen is not None:
            if size.steps < REPROBE_STEPS:
                size.steps += 1
                return size.chosen
            self._sizes[key] = size = _Size()
        one = size.timed.get(1, [])
        if len(one) < PROBE_STEPS:
            return 1
        step_s = statistics.median(one) * num_tokens
        wire_s = (round_trip_s or 0.0) * self.moe_layers
        if not (wire_s >= WIRE_SHARE * step_s
                or (self.device != "cpu" and num_tokens >= PIPELINE_MIN_TOKENS)):
            return self._decide(size, key, 1, f"the wire's round trips ({1e3 * wire_s:.1f} "
                                f"ms a step) are under {WIRE_SHARE:.0%} of a step")
        for count in CANDIDATES[1:key[1]]:
            if len(size.timed.get(count, [])) < PROBE_STEPS:
                return count
        per_token = {c: statistics.median(t) for c, t in size.timed.items()}
        best = min(per_token, key=per_token.__getitem__)
        return self._decide(size, key, best, "the fastest, " + ", ".join(
            f"{c}: {1e3 * t * num_tokens:.1f} ms" for c, t in sorted(per_token.items()))
            + f" a step (the wire {1e3 * wire_s:.1f} ms of it)")

    def observe(self, count: int, num_tokens: int, num_seqs: int, seconds: float) -> None:
        """A step of `num_tokens` and `num_seqs`, asked for `count` micro-batches, ran its
        forward in `seconds`."""
        size = self._sizes.get(self._key(num_tokens, num_seqs))
        if size is not None and size.chosen is None:
            size.timed.setdefault(count, []).append(seconds / num_tokens)

    def _decide(self, size: _Size, key: tuple[int, int], count: int, why: str) -> int:
        size.chosen, size.steps = count, 0
        low = 1 << (key[0] - 1) if key[0] else 0
        log.info("--micro-batches auto: steps of %d-%d tokens and %s sequences: %d "
                 "micro-batch%s (%s)", low, max(low, (1 << key[0]) - 1),
                 f"{key[1]}+" if key[1] == max(CANDIDATES) else key[1], count,
                 "" if count == 1 else "es", why)
        return count


def split(scheduled: list[ScheduledSeq], parts: int) -> list[list[ScheduledSeq]]:
    """`scheduled` in at most `parts` contiguous groups of about equal tokens, none empty.
    The groups keep the order, so their hidden states, concatenated, are the whole step's."""
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
