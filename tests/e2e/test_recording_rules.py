"""The recording rules (deploy/observability) in a real Prometheus scraping a running
server under load: every chart line is recorded from the gateway's /metrics, with
values that make sense (tokens flowing, p99 above p50, the ranks' shares summing to 1)."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import pytest

from gateway.observability.dashboard.charts import CHARTS, record_name
from gateway.observability.dashboard.exports import RULES_FILE
from switchyard.serve_process import Served
from tests.e2e.test_dashboard import generate
from tests.support import ROOT
from tests.support.tools import prometheus, wait_until

pytestmark = pytest.mark.timeout(300)


def query(base: str, expr: str) -> list[tuple[dict, float]]:
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return [(s["metric"], float(s["value"][1])) for s in r.json()["data"]["result"]]


def test_prometheus_records_every_chart_line_from_metrics(qwen3_ckpt: tuple) -> None:
    path, _ = qwen3_ckpt
    lines = [line for chart in CHARTS for line in chart.lines]
    with Served(["--model", str(path), "--expert-services", "2"]) as served, \
            ThreadPoolExecutor(1) as pool:
        config = ("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                  "scrape_configs:\n- job_name: gateway\n"
                  f"  static_configs: [{{targets: ['{urlsplit(served.url).netloc}']}}]")
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                generate(served.url, seed=87, lengths=(9, 5), tokens=24)

        running = pool.submit(load)
        try:
            with prometheus(config, ROOT / "deploy/observability" / RULES_FILE) as base:
                def recorded() -> dict | None:
                    got = {line.key: query(base, record_name(line)) for line in lines}
                    ok = all(got.values()) and all(
                        not math.isnan(v) for series in got.values() for _, v in series)
                    return got if ok else None

                got = wait_until(recorded, 90, lambda: f"every record in {base}")
        finally:
            stop.set()
        running.result(timeout=60)
    value = {key: series[0][1] for key, series in got.items()}  # type: ignore[union-attr]
    assert value["output_tokens_per_s"] > 0
    assert value["ttft_p99_s"] >= value["ttft_p50_s"] > 0
    assert value["tpot_p99_s"] >= value["tpot_p50_s"] > 0
    assert value["dispatch_p99_s"] > 0 and value["combine_p99_s"] > 0
    assert 0 <= value["kv_usage"] <= 1 and value["running"] >= 0 and value["waiting"] >= 0
    shares = got["rank_share"]  # type: ignore[index]
    assert sorted(labels["rank"] for labels, _ in shares) == ["0", "1"]
    assert sum(v for _, v in shares) == pytest.approx(1.0)
    assert 0.5 <= value["balancedness"] <= 1.0  # (two ranks: at worst one does it all)
