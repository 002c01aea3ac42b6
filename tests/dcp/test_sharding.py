"""Which DCP rank holds which positions, and what a group of D ranks can hold."""

from __future__ import annotations

import torch

from dcp.sharding import Sharding


def test_sharding_positions_and_capacity() -> None:
    s = Sharding(size=3, interleave=2)
    pos = torch.arange(12)
    assert s.owner(pos).tolist() == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]
    assert s.local_index(pos).tolist() == [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]
    assert [s.num_owned(r, 9) for r in range(3)] == [4, 3, 2]
    assert s.max_length(4) == 12 and Sharding(2).max_length(64) == 128
