"""The dashboard's answers (`gateway.observability.dashboard.page`) over a recorder's
readings."""

from __future__ import annotations

from types import SimpleNamespace

from gateway.observability.dashboard.page import expert_rows
from gateway.observability.dashboard.recorder import Recorder, Settings
from tests.gateway.observability.dashboard.test_windows import scrape


def test_the_dashboard_lists_an_experts_ranks_in_number_order() -> None:
    recorder = Recorder(Settings("m", "http://127.0.0.1:8000"), SimpleNamespace())  # type: ignore[arg-type]
    scrapes = [scrape(f"r{rank}", (1, 1), 1, rank=rank) for rank in ("10", "2", "9")]
    recorder.window.absorb(scrapes, 0.0)
    recent, _ = recorder.window.recent(0.0, 60)
    [entry] = expert_rows(recorder, recent)
    assert entry["ranks"] == ["2", "9", "10"]
