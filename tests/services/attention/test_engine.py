"""`services.attention.engine`: a step that fails fails only its own sequences."""

from __future__ import annotations

import pytest
import torch

from services.attention.engine import StepFailed
from tests.support.engines import engine_for, greedy


def test_a_failed_step_fails_only_its_own_sequences(qwen3_ckpt: tuple) -> None:
    """A step that raises names the sequences it ran; a waiting one, not in it, is
    untouched and completes."""
    engine = engine_for(qwen3_ckpt[0], dispatch_backend="local", max_num_seqs=1)
    inner = engine.runner.experts
    failing = [True]

    def experts(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
                ) -> torch.Tensor:
        if failing[0]:
            raise ExceptionGroup("unhandled errors in a TaskGroup",
                                 [RuntimeError("rank 0 down"), RuntimeError("rank 1 down")])
        return inner(layer, x, ids, w)

    engine.runner.experts = experts  # type: ignore[assignment]
    engine.runner.experts.begin_step = inner.begin_step  # type: ignore[attr-defined]
    assert engine.add(greedy("first", [1, 2, 3], 2)) is None
    assert engine.add(greedy("waiting", [4, 5, 6], 2)) is None
    with pytest.raises(StepFailed) as failed:
        engine.step()
    assert failed.value.request_ids == ["first"]
    assert str(failed.value) == "RuntimeError: rank 0 down; RuntimeError: rank 1 down"
    [delta] = engine.fail(failed.value.request_ids, "error")
    assert (delta.request_id, delta.finish_reason, delta.retryable) == ("first", "error", True)
    failing[0] = False
    tokens = []
    while engine.has_work():
        tokens += [(d.request_id, len(d.token_ids)) for d in engine.step()]
    assert tokens == [("waiting", 1), ("waiting", 1)]
