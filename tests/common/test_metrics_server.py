"""The services' /metrics server (common/metrics.py) under a real HTTP client."""

from __future__ import annotations

import httpx
from prometheus_client import Counter

from common.metrics import start_metrics_server

# What Prometheus 2 (Debian bookworm's 2.42) sends when it scrapes.
PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-"
                       "text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_series_keep_their_names_whatever_the_scraper_asks() -> None:
    """prometheus_client escapes `switchyard:x` to `switchyard_x` for an OpenMetrics
    scraper that allows no UTF-8; the classic text format keeps it."""
    Counter("switchyard:test_scrapes", "a test counter").inc()
    port = start_metrics_server("127.0.0.1", 0, "expert", 3)
    for accept in (PROMETHEUS_2_ACCEPT, None):
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10,
                      headers={"accept": accept} if accept else {})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        assert "\nswitchyard:test_scrapes_total 1.0\n" in r.text
        # what the dashboard names the service by
        assert 'switchyard:service_start_time_seconds{index="3",member="0",role="expert"}' \
            in r.text
    assert start_metrics_server("127.0.0.1", None, "expert", 3) is None
