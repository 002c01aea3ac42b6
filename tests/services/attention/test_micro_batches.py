"""How a step splits into ping-pong micro-batches (`services/attention/micro_batches.py`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.attention.micro_batches import (
    CANDIDATES,
    PIPELINE_MIN_TOKENS,
    PROBE_STEPS,
    REPROBE_STEPS,
    MicroBatchTuner,
    micro_batch_count,
    split,
)
from services.attention.scheduler import ScheduledSeq


def scheduled(tokens: list[int]) -> list[ScheduledSeq]:
    return [ScheduledSeq(seq=object(), num_new_tokens=n) for n in tokens]  # type: ignore[arg-type]


@given(st.lists(st.integers(1, 600), min_size=1, max_size=40), st.integers(1, 3))
def test_groups_are_contiguous_non_empty_and_at_most_asked(tokens: list[int], parts: int
                                                           ) -> None:
    items = scheduled(tokens)
    groups = split(items, parts)
    assert [item for g in groups for item in g] == items  # in order, each once
    assert all(groups) and len(groups) <= min(parts, len(items))
    if all(n == 1 for n in tokens) and len(tokens) >= parts:  # decodes: as even as can be
        assert len(groups) == parts
        assert max(map(len, groups)) - min(map(len, groups)) <= 1


@pytest.mark.parametrize(("setting", "overlaps", "want"), [
    ("2", True, 2), ("3", True, 3),  # as asked
    ("2", False, 1), ("auto", False, 1),  # a backend that cannot overlap: one batch
    ("auto", True, None),  # the tuner's
])
def test_how_many(setting: str, overlaps: bool, want: int | None) -> None:
    assert micro_batch_count(setting, overlaps) == want


def probe(tuner: MicroBatchTuner, step_ms: dict[int, float], tokens: int = 16,
          seqs: int = 16, round_trip_s: float | None = None) -> list[int]:
    """The counts `tuner` asks for over the probe and one step after, each step taking
    `step_ms[count]`."""
    asked = []
    for _ in range(PROBE_STEPS * len(CANDIDATES) + 1):
        count = tuner.choose(tokens, seqs, round_trip_s)
        asked.append(count)
        tuner.observe(count, tokens, seqs, step_ms[count] / 1e3)
    return asked


def test_auto_keeps_one_batch_where_the_wire_is_short(caplog: pytest.LogCaptureFixture
                                                     ) -> None:
    """On the CPU with a 0.1 ms round trip over 8 MoE layers against a 70 ms step, the
    tuner never tries a pipeline, and says why once."""
    tuner = MicroBatchTuner("cpu", moe_layers=8)
    with caplog.at_level("INFO", "switchyard.micro_batches"):
        asked = probe(tuner, {1: 70.0, 2: 50.0, 3: 40.0}, round_trip_s=1e-4)
    assert set(asked) == {1}
    [record] = caplog.records
    assert "1 micro-batch (the wire's round trips (0.8 ms a step) are under 10%" \
        in record.getMessage()


def test_auto_measures_each_count_where_the_wire_is_long(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    """A 10 ms round trip over 8 layers against a 170 ms step: each count is timed over
    `PROBE_STEPS` steps, and the fastest is kept (and logged with the others' times)."""
    tuner = MicroBatchTuner("cpu", moe_layers=8)
    with caplog.at_level("INFO", "switchyard.micro_batches"):
        asked = probe(tuner, {1: 170.0, 2: 153.0, 3: 163.0}, round_trip_s=0.01)
    assert asked == [1] * PROBE_STEPS + [2] * PROBE_STEPS + [3] * PROBE_STEPS + [2]
    assert tuner.choose(16, 16, 0.01) == 2
    [record] = caplog.records
    assert "2 micro-batches (the fastest, 1: 170.0 ms, 2: 153.0 ms, 3: 163.0 ms a step " \
        "(the wire 80.0 ms of it))" in record.getMessage()


def test_auto_chooses_per_size_and_again_later() -> None:
    """A step size's choice holds for `REPROBE_STEPS` steps of that size, then is measured
    again; another size (tokens to the power of two, sequences up to 3) is its own; one
    sequence is never split; a GPU tries pipelines from `PIPELINE_MIN_TOKENS` tokens."""
    tuner = MicroBatchTuner("cpu", moe_layers=8)
    probe(tuner, {1: 170.0, 2: 153.0, 3: 163.0}, round_trip_s=0.01)
    assert tuner.choose(16, 2, 0.01) == 1  # 2 sequences: not probed yet
    assert tuner.choose(40, 16, 0.01) == 1  # 32-63 tokens: not probed yet
    assert tuner.choose(1, 1, 0.01) == 1
    for _ in range(REPROBE_STEPS):
        assert tuner.choose(17, 16, 0.01) == 2  # (16-31 tokens)
    assert tuner.choose(16, 16, 0.01) == 1  # measured again from one batch
    gpu = MicroBatchTuner("cuda", moe_layers=8)
    step = {1: 10.0, 2: 7.0, 3: 8.0}
    assert probe(gpu, step, tokens=PIPELINE_MIN_TOKENS)[-1] == 2
    assert set(probe(gpu, step, tokens=PIPELINE_MIN_TOKENS - 1)) == {1}
