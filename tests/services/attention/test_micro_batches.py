"""How a step splits into ping-pong micro-batches (`services/attention/micro_batches.py`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.attention.micro_batches import PIPELINE_MIN_TOKENS, micro_batch_count, split
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


@pytest.mark.parametrize(("setting", "tokens", "overlaps", "device", "want"), [
    ("2", 1, True, "cpu", 2), ("3", 500, True, "cpu", 3),  # as asked
    ("2", 64, False, "cpu", 1),  # a backend that cannot overlap: one batch
    ("auto", 512, True, "cpu", 1),  # the CPU shares its cores: measured not to pay
    ("auto", PIPELINE_MIN_TOKENS, True, "cuda", 2),
    ("auto", PIPELINE_MIN_TOKENS - 1, True, "cuda", 1),
])
def test_how_many(setting: str, tokens: int, overlaps: bool, device: str, want: int) -> None:
    assert micro_batch_count(setting, tokens, overlaps, device) == want
