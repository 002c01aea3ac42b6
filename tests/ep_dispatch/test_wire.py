"""`ep_dispatch.wire`: tensors to wire bytes and back."""

from __future__ import annotations

import torch

from ep_dispatch.wire import from_wire, to_wire


def test_wire_round_trip_of_views_and_empty_tensors() -> None:
    for t in (torch.randn(5, 3)[:, 1], torch.empty(0, 4), torch.tensor(3, dtype=torch.int64),
              torch.randn(4, 4, dtype=torch.bfloat16).t()):
        back = from_wire(to_wire(t))
        assert back.dtype == t.dtype and torch.equal(back, t)
