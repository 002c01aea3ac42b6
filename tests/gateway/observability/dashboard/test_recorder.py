"""The recorder's reading of the services: names by role and place, events when a service
goes down, comes back or restarts, and each tick's chart values."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.observability.dashboard.recorder import Recorder, Settings, identity, point_values
from gateway.observability.dashboard.windows import Hist
from gateway.observability.service_metrics import Scrape, parse

INF = float("inf")


def service(url: str, role: str, index: int, member: int = 0, started: float = 1.0) -> Scrape:
    text = f"""# TYPE switchyard:service_start_time_seconds gauge
switchyard:service_start_time_seconds{{role="{role}",index="{index}",member="{member}"}} {started}
# TYPE switchyard:busy_fraction gauge
switchyard:busy_fraction{{service="{role}"}} 0.25
"""
    return Scrape(url, parse(text))


def test_services_are_named_by_role_and_place() -> None:
    assert identity("u", service("u", "attention", 0, 1).families)[:4] == (
        "attention group 0 (DCP rank 1)", "attention", 0, 1)
    assert identity("u", service("u", "attention", 3).families)[0] == "attention group 3"
    assert identity("u", service("u", "expert", 2, started=7.5).families) == (
        "expert rank 2", "expert", 2, 0, 7.5)
    assert identity("http://x/metrics", [])[:2] == ("http://x/metrics", "")  # (it said nothing)


def recorder() -> Recorder:
    return Recorder(Settings("m", "http://127.0.0.1:8000", interval_s=1),
                    SimpleNamespace(), history_s=60)  # type: ignore[arg-type]


def test_a_service_going_down_coming_back_and_restarting_are_events() -> None:
    r = recorder()
    r._note_services([service("e1", "expert", 1), service("a", "attention", 0),
                      service("e0", "expert", 0)])
    assert [s.name for s in r.services] == [
        "gateway", "attention group 0", "expert rank 0", "expert rank 1"]
    assert r.services[2].busy == {"expert": 0.25} and not r.events
    r._note_services([Scrape("e1", error="ConnectError: refused"),
                      service("a", "attention", 0), service("e0", "expert", 0)])
    down = next(s for s in r.services if s.url == "e1")
    assert (down.name, down.up, down.detail) == ("expert rank 1", False, "ConnectError: refused")
    r._note_services([service("e1", "expert", 1, started=5.0), service("a", "attention", 0),
                      service("e0", "expert", 0, started=6.0)])  # e0: restarted unseen
    assert [(e.kind, e.text) for e in r.events] == [
        ("down", "expert rank 1 down: ConnectError: refused"),
        ("up", "expert rank 1 up again"),
        ("restart", "expert rank 0 restarted")]
    assert next(s for s in r.services if s.url == "e1").started == 5.0


def test_a_ticks_values_are_the_charts() -> None:
    added = {("rank", "1", "0"): Hist((), (), tokens=30.0),
             ("rank", "1", "1"): Hist((), (), tokens=10.0),
             ("rank", "2", "0"): Hist((), (), tokens=20.0),
             ("rank", "2", "1"): Hist((), (), tokens=20.0),
             ("counter", "output_tokens"): Hist((), (), tokens=50.0),
             ("request", "ttft"): Hist((0.1, 1.0, INF), (2.0, 6.0, 8.0)),
             ("dispatch", "rpc"): Hist((0.001, INF), (1.0, 1.0)),
             ("dispatch", "local"): Hist((0.001, INF), (0.0, 1.0))}
    values = point_values(added, seconds=2.0)
    assert values["output_tokens_per_s"] == 25.0
    assert values["ttft_p50_s"] == pytest.approx(0.55)  # (test_windows' hand-computed case)
    assert values["rank_share:0"] == pytest.approx(50 / 80)
    assert values["rank_share:1"] == pytest.approx(30 / 80)
    assert values["balancedness"] == pytest.approx((20 + 20) / (30 + 20))
    assert values["dispatch_p99_s"] == pytest.approx(0.001)  # both backends' calls summed
    assert values["tpot_p99_s"] is None and values["combine_p99_s"] is None
