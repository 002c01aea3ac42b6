"""The attention and expert services' `/metrics`, scraped on demand and merged.

Samples with the same name and labels from several services are summed: counters and
histogram buckets add up (two attention groups' dispatch histograms become one), and
per-expert series never collide, as they carry the expert rank. `_created` series are
dropped: a sum of start times means nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import anyio
import httpx
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

PREFIX = "switchyard:"


@dataclass(frozen=True)
class Scrape:
    """One service's `/metrics` as read now; `error` says why it could not be."""

    url: str
    families: list[Metric] = field(default_factory=list)
    error: str | None = None

    @property
    def up(self) -> bool:
        return self.error is None


class ServiceMetrics:
    """Scrapes a fixed list of `/metrics` URLs, all at once, each bounded by `timeout`."""

    def __init__(self, urls: Iterable[str], timeout: float = 2.0) -> None:
        self.urls = list(urls)
        self.timeout = timeout

    async def scrape(self) -> list[Scrape]:
        results: list[Scrape] = [Scrape(u) for u in self.urls]
        async with httpx.AsyncClient(timeout=self.timeout) as client:

            async def one(i: int, url: str) -> None:
                try:
                    response = await client.get(url)
                    response.raise_for_status()
                    families = [f for f in text_string_to_metric_families(response.text)
                                if f.name.startswith(PREFIX) and
                                not f.name.endswith("_created")]
                    results[i] = Scrape(url, families)
                except (httpx.HTTPError, ValueError) as exc:
                    results[i] = Scrape(url, error=f"{type(exc).__name__}: {exc}")

            async with anyio.create_task_group() as tg:
                for i, url in enumerate(self.urls):
                    tg.start_soon(one, i, url)
        return results


def merge(scrapes: Iterable[Scrape]) -> list[Metric]:
    """One family per name over every service that answered; equal samples summed."""
    merged: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for scrape in scrapes:
        for family in scrape.families:
            if family.name not in merged:
                merged[family.name] = Metric(family.name, family.documentation, family.type)
                values[family.name] = {}
            samples = values[family.name]
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                samples[key] = samples.get(key, 0.0) + s.value
    for name, family in merged.items():
        for (sample, labels), value in values[name].items():
            family.add_sample(sample, dict(labels), value)
    return list(merged.values())


class Families(Collector):
    """A prometheus_client collector of fixed families (to render merged ones)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
