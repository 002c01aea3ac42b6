"""DeepSeek's EPLB, ported: its README's example, and the properties a placement needs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_dispatch.eplb import placement_from_load, rebalance_experts
from ep_dispatch.placement import Placement, PlacementError


def test_the_readme_example() -> None:
    """github.com/deepseek-ai/EPLB's README: 2 layers of 12 experts, 4 redundant, 4 groups,
    2 nodes of 4 GPUs (the hierarchical policy)."""
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    phy2log, log2phy, count = rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    for layer in range(2):  # log2phy and count describe the same plan
        for expert in range(12):
            copies = [p for p in log2phy[layer, expert].tolist() if p >= 0]
            assert len(copies) == count[layer, expert]
            assert all(phy2log[layer, p] == expert for p in copies)


def rank_loads(placement: Placement, load: torch.Tensor, layer_row: int, layer: int
               ) -> list[float]:
    """Each rank's expected rows: an expert's rows split evenly over its copies."""
    out = [0.0] * placement.num_ranks
    for expert, ranks in enumerate(placement.replicas[layer]):
        for r in ranks:
            out[r] += float(load[layer_row, expert]) / len(ranks)
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4).flatmap(lambda ranks: st.tuples(
    st.just(ranks), st.sampled_from([8, 16]), st.integers(0, 3),
    st.lists(st.integers(0, 1000), min_size=32, max_size=32))))
def test_copies_go_to_the_heaviest_and_every_rank_holds_its_share(
        case: tuple[int, int, int, list[int]]) -> None:
    ranks, experts, extra_per_rank, loads = case
    redundant = extra_per_rank * ranks + (-experts) % ranks
    load = torch.tensor(loads[: 2 * experts], dtype=torch.float32).view(2, experts)
    placement = placement_from_load(load, [1, 3], ranks, redundant)
    per_rank = (experts + redundant) // ranks
    for row, layer in enumerate((1, 3)):
        copies = placement.replicas[layer]
        assert all(copies[e] for e in range(experts))  # every expert kept
        held = [sum(r == rank for c in copies for r in c) for rank in range(ranks)]
        assert held == [per_rank] * ranks  # the per-rank memory limit, exactly
        for a in range(experts):  # a heavier expert never has fewer copies
            for b in range(experts):
                if load[row, a] > load[row, b]:
                    assert len(copies[a]) >= len(copies[b])


def test_a_skewed_load_is_balanced_by_redundant_copies() -> None:
    """Two experts take most rows, and round-robin puts both on rank 3 (3.4x its fair
    share); with 4 redundant copies over 4 ranks EPLB's busiest rank has 1.25x."""
    load = torch.full((1, 16), 10.0)
    load[0, 3], load[0, 11] = 400.0, 300.0
    balanced = Placement.balanced([0], 16, 4)
    eplb = placement_from_load(load, [0], 4, 4)
    fair = float(load.sum()) / 4
    before = max(rank_loads(balanced, load, 0, 0))
    after = max(rank_loads(eplb, load, 0, 0))
    assert before / fair > 3.4 and after / fair < 1.3
    assert len(eplb.replicas[0][3]) >= 2 and len(eplb.replicas[0][11]) >= 2


@pytest.mark.parametrize(("experts", "redundant", "ranks", "groups", "nodes", "message"), [
    (16, 1, 4, 1, 1, "do not fill 4 ranks evenly"),
    (16, 0, 3, 1, 1, "do not fill 3 ranks evenly"),
    (16, 0, 4, 3, 1, "3 expert groups do not divide 16 experts"),
    (16, 0, 4, 1, 3, "4 expert ranks cannot be split over 3 nodes"),
])
def test_a_placement_that_cannot_fit_is_a_clear_error(
        experts: int, redundant: int, ranks: int, groups: int, nodes: int,
        message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        placement_from_load(torch.ones(1, experts), [0], ranks, redundant, groups, nodes)
