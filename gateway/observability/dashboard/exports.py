"""The dashboard's charts (`charts.CHARTS`) for operators who watch with Prometheus and
Grafana: a recording rule per line, and a Grafana dashboard of one time-series panel per
chart over those rules, with rebalances and services going down as annotations.

`python -m gateway.observability.dashboard.exports --out deploy/observability` writes both; the
committed files are what it writes (tests/gateway/observability/dashboard/test_exports.py).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import yaml

from gateway.observability.dashboard.charts import CHARTS, RANGE, record_name

RULES_FILE = "switchyard.rules.yml"
GRAFANA_FILE = "switchyard.grafana.json"
# Grafana's unit for each of the charts' units
UNITS = {"tokens/s": "short", "s": "s", "requests": "short", "fraction": "percentunit"}
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ANNOTATIONS = (  # (name, colour, expression): when each is non-empty, a mark
    ("rebalances", "purple", f"changes(switchyard:eplb_placement_version[{RANGE}]) > 0"),
    ("services down", "red", "switchyard:service_up == 0"),
    ("restarts", "orange", f"changes(switchyard:service_start_time_seconds[{RANGE}]) > 0"),
)


def recording_rules() -> dict[str, object]:
    """Prometheus' rule file: every chart line as a recorded series."""
    return {"groups": [{"name": "switchyard", "rules": [
        {"record": record_name(line), "expr": line.promql}
        for chart in CHARTS for line in chart.lines]}]}


def _panel(i: int, chart_index: int) -> dict[str, object]:
    chart = CHARTS[chart_index]
    return {
        "id": i, "type": "timeseries", "title": chart.title, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 8, "x": 8 * (chart_index % 3), "y": 8 * (chart_index // 3)},
        "fieldConfig": {"defaults": {"unit": UNITS[chart.unit]}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom",
                               "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"refId": chr(ord("A") + j), "datasource": DATASOURCE,
                     "expr": record_name(line), "legendFormat": line.legend}
                    for j, line in enumerate(chart.lines)],
    }


def grafana_dashboard() -> dict[str, object]:
    """A Grafana dashboard (JSON model, schema version 39) of the recorded series."""
    return {
        "uid": "switchyard", "title": "Switchyard", "tags": ["switchyard"],
        "timezone": "browser", "editable": True, "graphTooltip": 1, "schemaVersion": 39,
        "time": {"from": "now-15m", "to": "now"}, "refresh": "10s",
        "templating": {"list": [{"name": "datasource", "label": "Prometheus",
                                 "type": "datasource", "query": "prometheus"}]},
        "annotations": {"list": [
            {"name": name, "enable": True, "iconColor": colour, "datasource": DATASOURCE,
             "expr": expr} for name, colour, expr in ANNOTATIONS]},
        "panels": [_panel(i + 1, i) for i in range(len(CHARTS))],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.observability.dashboard.exports",
                                     description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the folder to write to")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    header = "# Written by `python -m gateway.observability.dashboard.exports`.\n"
    (args.out / RULES_FILE).write_text(
        header + yaml.safe_dump(recording_rules(), sort_keys=False, width=100))
    (args.out / GRAFANA_FILE).write_text(json.dumps(grafana_dashboard(), indent=2) + "\n")
    print(f"wrote {args.out / RULES_FILE} and {args.out / GRAFANA_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
