"""deploy/observability: the recording rules and the Grafana dashboard are what
`gateway.observability.dashboard.exports` writes from the dashboard's chart definitions; Prometheus'
promtool accepts the rules, and Grafana's dashboard model (the Grafana Foundation SDK's,
generated from Grafana's schema) reads every field of the dashboard."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from gateway.observability.dashboard.charts import CHARTS, record_name
from gateway.observability.dashboard.exports import GRAFANA_FILE, RULES_FILE, main
from tests.support import ROOT
from tests.support.tools import PROMTOOL, prometheus_tool

FOLDER = ROOT / "deploy/observability"


def test_the_committed_files_are_what_the_charts_write(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path)]) == 0
    for name in (RULES_FILE, GRAFANA_FILE):
        assert (tmp_path / name).read_text() == (FOLDER / name).read_text(), \
            f"rewrite: python -m gateway.observability.dashboard.exports --out {FOLDER}"


def test_promtool_accepts_the_recording_rules() -> None:
    done = subprocess.run([prometheus_tool(PROMTOOL), "check", "rules", FOLDER / RULES_FILE],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {sum(len(c.lines) for c in CHARTS)} rules found" in done.stdout


def contained(part: object, whole: object, path: str = "") -> list[str]:
    """Where `part` is not contained in `whole` (every key and item kept, equal values)."""
    if isinstance(part, dict):
        if not isinstance(whole, dict):
            return [path]
        return [p for k, v in part.items()
                for p in (contained(v, whole[k], f"{path}/{k}") if k in whole else [f"{path}/{k}"])]
    if isinstance(part, list):
        if not isinstance(whole, list) or len(part) != len(whole):
            return [path]
        return [p for i, (a, b) in enumerate(zip(part, whole, strict=True))
                for p in contained(a, b, f"{path}[{i}]")]
    return [] if part == whole else [path]


def test_grafanas_dashboard_model_reads_every_field_of_the_dashboard() -> None:
    written = json.loads((FOLDER / GRAFANA_FILE).read_text())
    read = json.loads(json.dumps(Dashboard.from_json(written), cls=JSONEncoder))
    assert contained(written, read) == []
    # one panel per chart, one query per line, each a recorded series
    assert [p["title"] for p in read["panels"]] == [c.title for c in CHARTS]
    assert [[t["expr"] for t in p["targets"]] for p in read["panels"]] == [
        [record_name(line) for line in c.lines] for c in CHARTS]
