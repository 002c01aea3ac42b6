"""Reading Prometheus text with prometheus_client's own parser (not ours)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


def scrape(url: str) -> dict[str, dict[Labels, float]]:
    """GET url -> {sample name: {sorted labels: value}}."""
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def per_expert(samples: dict[str, dict[Labels, float]], name: str
               ) -> dict[tuple[int, int], float]:
    """A per-expert series summed over ranks: {(layer, expert): value}."""
    out: dict[tuple[int, int], float] = {}
    for labels, value in samples.get(name, {}).items():
        d = dict(labels)
        key = (int(d["layer"]), int(d["expert"]))
        out[key] = out.get(key, 0.0) + value
    return out


def buckets(samples: dict[str, dict[Labels, float]], name: str, **match: str
            ) -> dict[float, float]:
    """A histogram's cumulative bucket counts {le: count} summed over the other labels,
    for the samples whose labels include `match`."""
    out: dict[float, float] = {}
    for labels, value in samples.get(f"{name}_bucket", {}).items():
        d = dict(labels)
        if all(d.get(k) == v for k, v in match.items()):
            le = float(d["le"])
            out[le] = out.get(le, 0.0) + value
    return out
