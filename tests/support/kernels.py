"""Checks the kernel tests share."""

from __future__ import annotations


def assert_expert_spans(spans: list[tuple[int, int]], counts: list[int]) -> None:
    """One span per local expert: (0, 0) without rows, else its start and end, one expert
    after another in expert order."""
    assert len(spans) == len(counts)
    for (start, end), count in zip(spans, counts, strict=True):
        assert (start, end) == (0, 0) if count == 0 else 0 < start <= end, (spans, counts)
    ran = [span for span, count in zip(spans, counts, strict=True) if count]
    assert ran == sorted(ran)  # one after another, in expert order
