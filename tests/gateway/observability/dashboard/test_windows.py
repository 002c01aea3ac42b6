"""The dashboard's numbers: Prometheus' histogram_quantile on hand-computed cases, and
windows over several services that restart or fail to answer."""

from __future__ import annotations

import pytest

from gateway.config import parse_args
from gateway.observability.dashboard.windows import COPIES, Hist, Window
from gateway.observability.metrics import balance
from gateway.observability.service_metrics import Scrape, parse
from switchyard.demo_model import DEFAULT_MODEL

INF = float("inf")


@pytest.mark.parametrize(("counts", "q", "expected"), [
    ((2, 6, 8), 0.5, 0.55),  # rank 4 in (0.1, 1]: 0.1 + 0.9 * (4 - 2) / (6 - 2)
    ((2, 6, 8), 0.1, 0.04),  # rank 0.8 in the first bucket, from 0: 0.1 * 0.8 / 2
    ((2, 6, 8), 0.99, 1.0),  # rank 7.92 in +Inf: the largest finite bound
    ((0, 0, 5), 0.5, 1.0),
    ((5, 3, 3), 0.9, 0.09),  # forced monotonic (5, 5, 5): rank 4.5 of 5 in (0, 0.1]
    ((1, 1 + 1e-13, 2), 0.75, 1.0),  # a precision wobble is no observation
])
def test_quantile_is_prometheus_histogram_quantile(counts: tuple, q: float,
                                                   expected: float) -> None:
    assert Hist((0.1, 1.0, INF), counts).quantile(q) == pytest.approx(expected)


@pytest.mark.parametrize("hist", [Hist((INF,), (3,)), Hist((0.1, INF), (0, 0)),
                                  Hist((0.1, 1.0), (1, 2))])
def test_quantile_is_none_where_prometheus_gives_nan(hist: Hist) -> None:
    assert hist.quantile(0.5) is None  # one bucket, no observation, no +Inf bucket


def test_quantile_zero_over_an_empty_first_bucket() -> None:
    assert Hist((0.1, 1.0, INF), (0, 4, 4)).quantile(0.0) is None


def scrape(url: str, counts: tuple[int, int], tokens: int, total_s: float = 0.01,
           rank: str = "0") -> Scrape:
    """A service reporting expert (layer 0, expert 1) of `rank` (two local-backend
    attention groups both report rank 0)."""
    labels = f'layer="0",expert="1",rank="{rank}"'
    text = f"""# TYPE switchyard:expert_compute_seconds histogram
switchyard:expert_compute_seconds_bucket{{{labels},le="0.001"}} {counts[0]}
switchyard:expert_compute_seconds_bucket{{{labels},le="+Inf"}} {counts[1]}
switchyard:expert_compute_seconds_count{{{labels}}} {counts[1]}
switchyard:expert_compute_seconds_sum{{{labels}}} {total_s}
# TYPE switchyard:expert_tokens_total counter
switchyard:expert_tokens_total{{{labels}}} {tokens}
"""
    return Scrape(url, parse(text))


def expert(window: Window, now: float, seconds: float) -> tuple[Hist, float | None]:
    recent, age = window.recent(now, seconds)
    return recent[("expert", "0", "1")], age


def test_windows_survive_restarts_and_failed_scrapes() -> None:
    w = Window(900)
    w.absorb([scrape("a", (2, 4), 40), scrape("b", (1, 1), 5)], now=0)
    h, age = expert(w, 0, 60)
    assert (h.counts, h.tokens, age) == ((3, 5), 45, None)  # since the services started

    # a restarted: all it holds is new; b grew. The last 10 s: only what was added.
    w.absorb([scrape("a", (0, 1), 3), scrape("b", (1, 3), 20)], now=20)
    h, age = expert(w, 20, 10)
    assert (h.counts, h.tokens, age) == ((0, 3), 18, 20)

    # a does not answer; when it does, what it counted meanwhile arrives, counted once.
    w.absorb([Scrape("a", error="timeout"), scrape("b", (1, 4), 25)], now=30)
    w.absorb([scrape("a", (0, 2), 6), scrape("b", (1, 4), 25)], now=40)
    h, age = expert(w, 40, 15)
    assert (h.counts, h.tokens, age) == ((0, 2), 8, 20)
    assert h.quantile(0.5) == pytest.approx(0.001)  # both in (0.001, +Inf]: the bound


def test_balancedness_is_the_mean_over_the_max_of_the_ranks_rows() -> None:
    """vLLM's balancedness: per layer mean / max over ranks; overall the means summed over
    the maxima summed (the slowest rank of each layer sets its pace)."""
    load = balance({(0, 0): 30.0, (0, 1): 10.0, (2, 0): 20.0, (2, 1): 20.0})
    assert load["layers"] == {"0": pytest.approx(20 / 30), "2": 1.0}
    assert load["balancedness"] == pytest.approx((20 + 20) / (30 + 20))
    assert load["ranks"] == [{"rank": 0, "tokens": 50.0}, {"rank": 1, "tokens": 30.0}]
    assert balance({})["balancedness"] is None  # no rows yet: nothing to say


def test_a_ranks_rows_over_a_window() -> None:
    w = Window(900)
    w.absorb([scrape("a", (2, 4), 40, rank="0"), scrape("b", (1, 1), 5, rank="1")], now=0)
    w.absorb([scrape("a", (2, 5), 70, rank="0"), scrape("b", (1, 2), 15, rank="1")], now=20)
    recent, _ = w.recent(20, 10)
    assert {k: h.tokens for k, h in recent.items() if k[0] == "rank"} == {
        ("rank", "0", "0"): 30, ("rank", "0", "1"): 10}


def test_bad_gateway_settings_fail_at_start(capsys: pytest.CaptureFixture) -> None:
    base = ["--model", str(DEFAULT_MODEL), "--engine", "127.0.0.1:1"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--service-metrics", "http://host:port/metrics"])
    assert "--service-metrics" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args([*base, "--dashboard-window", "7200"])
    assert "--dashboard-window must be in (0, 900]" in capsys.readouterr().err


def test_each_tick_and_the_history_are_kept_and_bounded() -> None:
    """A copy of the totals at each tick, none older than the history (but the one a
    window of the whole history starts from); a tick's increase and one key's series."""
    w = Window(history_s=10)
    for t, tokens in enumerate((40, 70, 75, 75, 90)):
        w.absorb([scrape("a", (1, 1 + t), tokens)], now=t)
    added, seconds = w.last_tick()
    assert (added[("expert", "0", "1")].tokens, seconds) == (15, 1)
    series = w.series(("expert", "0", "1"), since=1)
    assert [(t, h.tokens, h.counts[-1]) for t, h in series] == [
        (2, 5, 1), (3, 0, 1), (4, 15, 1)]
    for t in range(5, 40):
        w.absorb([scrape("a", (1, 5), 90)], now=t)
    assert len(w._kept) == 11  # t = 29..39: ten seconds back, and the copy at 29
    recent, age = w.recent(39, 10)
    assert (recent[("expert", "0", "1")].tokens, age) == (0, 10)
    assert w.recent(39, None)[1] is None  # since start: every token
    assert w.recent(39, None)[0][("expert", "0", "1")].tokens == 90


def test_the_gateways_latencies_and_counters_are_windowed_too() -> None:
    text = """# TYPE switchyard:time_to_first_token_seconds histogram
switchyard:time_to_first_token_seconds_bucket{model_name="m",le="0.1"} %d
switchyard:time_to_first_token_seconds_bucket{model_name="m",le="+Inf"} %d
switchyard:time_to_first_token_seconds_sum{model_name="m"} 0.5
switchyard:time_to_first_token_seconds_count{model_name="m"} %d
# TYPE switchyard:generation_tokens_total counter
switchyard:generation_tokens_total{model_name="m"} %d
"""
    w = Window(900)
    w.absorb([Scrape("gateway", parse(text % (1, 2, 2, 10)))], now=0)
    w.absorb([Scrape("gateway", parse(text % (4, 6, 6, 25)))], now=5)
    added, seconds = w.last_tick()
    assert added[("request", "ttft")].counts == (3, 4)
    assert (added[("counter", "output_tokens")].tokens, seconds) == (15, 5)


def test_copies_are_kept_a_ninetieth_of_the_history_apart() -> None:
    """Ticks every second over a 900 s history keep about 90 copies; a window starts at the
    newest copy at least that old, so it spans at most 10 s more than asked."""
    w = Window(900)
    for t in range(1000):
        w.absorb([scrape("a", (1, 1 + t), t)], now=t)
    assert len(w._kept) <= COPIES + 1
    for window in (60, 300, 900):
        recent, age = w.recent(999, window)
        assert age is not None and window <= age <= window + 10
        assert recent[("expert", "0", "1")].tokens == age  # (a token a second)
    added, seconds = w.last_tick()  # the last tick itself, whatever was kept
    assert (added[("expert", "0", "1")].tokens, seconds) == (1, 1)
