"""The gateway's EPLB controller, apart from the services: which routing load a
rebalance balances (the window of steps), and what counts as a moved copy."""

from __future__ import annotations

import pytest

from common.messages import EngineStats
from gateway.routing.rebalancer import EplbConfig, Rebalancer, _moved


def stats(steps: int, load: list[list[int]]) -> EngineStats:
    return EngineStats(0, 0, 0, 1, 0, load, num_steps=steps)


def test_the_window_is_the_load_of_at_least_its_steps_summed_over_the_groups() -> None:
    rebalancer = Rebalancer(None, EplbConfig(enabled=True, window=15))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no routing load was read yet"):
        rebalancer.window_load([0])
    # two groups: layer 0 dense (zeros), layer 1 with 3 experts; cumulative counters
    for steps, a, b in [(0, [0, 0, 0], [0, 0, 0]), (4, [1, 2, 3], [0, 0, 1]),
                        (10, [2, 4, 6], [1, 0, 1]), (16, [9, 4, 6], [1, 5, 1])]:
        rebalancer._observe([stats(steps, [[0, 0, 0], a]), stats(steps, [[0, 0, 0], b])])
    # 32 steps summed; the newest snapshot at least 15 steps back is at 8 (4 + 4)
    assert rebalancer.window_load([1]) == [[9, 7, 3]]
    rebalancer._observe([stats(1, [[0, 0, 0], [1, 1, 1]])])  # a group restarted: anew
    assert rebalancer.window_load([1]) == [[1, 1, 1]]


def test_a_moved_copy_is_one_on_a_rank_that_did_not_hold_its_expert() -> None:
    old = {"num_ranks": 2, "layers": {"0": [[0], [1], [0]]}}
    new = {"num_ranks": 2, "layers": {"0": [[0, 1], [0], [0]]}}
    assert _moved(old, new) == 2  # expert 0 onto rank 1, expert 1 onto rank 0
    assert _moved(None, new) == 4 and _moved(new, new) == 0


def test_readings_kept_for_a_window_stay_few_whatever_the_steps() -> None:
    """A reading a second, for hours of slow steps, keeps about KEEP of them: a window's
    start known to 1/KEEP of it, its load at least the window's."""
    from gateway.routing.rebalancer import KEEP

    rebalancer = Rebalancer(None, EplbConfig(enabled=True, window=640))  # type: ignore[arg-type]
    for steps in range(5000):  # one step a reading; every step routes 1 token to expert 0
        rebalancer._observe([stats(steps, [[steps, 0]])])
    assert len(rebalancer._kept) <= KEEP + 1
    window = rebalancer.window_load([0])[0][0]
    assert 640 <= window <= 640 + 640 // KEEP
    for _ in range(100):  # idle: the readings do not grow
        rebalancer._observe([stats(4999, [[4999, 0]])])
    assert len(rebalancer._kept) <= KEEP + 1


def test_an_attention_service_plans_eplb_for_the_gateway() -> None:
    """The gateway has no torch: an attention service runs EPLB for it, and says why
    where a load cannot be placed."""
    import json

    from common.messages import PlanPlacement
    from services.attention.server import plan_placement

    plan = plan_placement(PlanPlacement([[90, 1, 1, 8]], [3], 2, num_redundant=2))
    layers = json.loads(plan.placement or "")["layers"]
    assert plan.error is None and sum(map(len, layers["3"])) == 6  # 4 experts + 2 copies
    assert len(layers["3"][0]) == 3  # both extra copies to the hot expert
    bad = plan_placement(PlanPlacement([[1, 1, 1, 1]], [3], 3, num_redundant=1))
    assert bad.placement is None and "3" in (bad.error or "")
