"""The attention and expert services' `/metrics`, scraped on demand and merged.

Samples with the same name and labels from several services are summed. Counters and
histogram buckets add up, so two attention groups' dispatch histograms become one. Direct
Prometheus scrapes of the services keep them apart by `instance`. `_created` series are
dropped, because a sum of start times means nothing.

The text is parsed in a worker thread. A large model's services export tens of thousands
of series, and the gateway's event loop must keep streaming tokens while they are read.
`/metrics` and the dashboard's recorder each scrape afresh when they read.
"""

from __future__ import annotations

import re
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
    """One service's `/metrics` as read now. `error` says why it could not be read."""

    url: str
    families: list[Metric] = field(default_factory=list)
    error: str | None = None

    @property
    def up(self) -> bool:
        return self.error is None


def check_url(url: str) -> str:
    """Return `url` if it is an http(s) URL with a host. Otherwise raise a ValueError
    naming it."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"{url!r} is not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not an http(s) URL with a host")
    return url


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _unescape(value: str) -> str:
    return re.sub(r'\\[\\"n]', lambda m: _ESCAPES[m.group(0)], value) if "\\" in value else value


def parse(text: str) -> list[Metric]:
    """Switchyard's families of one exposition text, as prometheus_client's parser reads
    them.

    As in that parser, a counter's family is named without `_total`. `_created` series
    are left out. The text is what prometheus_client writes, in the classic format: a
    TYPE line before each family's samples, and no timestamps. A large model's expert
    ranks write a quarter of a million lines per scrape. prometheus_client's general
    parser reads them about four times slower than this one, so it only gets text that
    this one does not expect.
    """
    families: dict[str, Metric] = {}
    family: Metric | None = None
    helps: dict[str, str] = {}
    try:
        for line in text.splitlines():
            if line.startswith("# HELP "):
                _, _, name, doc = line.split(" ", 3)
                helps[name] = doc.replace("\\n", "\n").replace("\\\\", "\\")
            elif line.startswith("# TYPE "):
                _, _, raw, kind = line.split(" ", 3)
                name = raw[:-len("_total")] if kind == "counter" and raw.endswith("_total") \
                    else raw
                wanted = name.startswith(PREFIX) and not name.endswith("_created")
                family = families.setdefault(name, Metric(name, helps.get(raw, ""), kind)) \
                    if wanted else None
            elif family is not None and line and not line.startswith("#"):
                if "{" in line:  # (the labels end at the last brace: none follows them)
                    head, _, rest = line.rpartition("}")
                    sample, _, labels = head.partition("{")
                else:
                    sample, _, rest = line.partition(" ")
                    labels = ""
                value, *timestamp = rest.split()
                if timestamp:  # prometheus_client writes none: the general parser reads it
                    raise ValueError("a sample with a timestamp")
                if not sample.endswith("_created"):
                    family.add_sample(sample, {k: _unescape(v) for k, v in _LABEL.findall(labels)},
                                      float(value))
    except ValueError:  # not the text we expect, so the general parser reads it
        return [f for f in text_string_to_metric_families(text)
                if f.name.startswith(PREFIX) and not f.name.endswith("_created")]
    return list(families.values())


class ServiceMetrics:
    """Scrapes a fixed list of `/metrics` URLs, all at once, each bounded by `timeout`."""

    def __init__(self, urls: Iterable[str], timeout: float = 2.0) -> None:
        self.urls = [check_url(u) for u in urls]
        self.timeout = timeout

    async def scrape(self) -> list[Scrape]:
        """Every service's families, scraped now."""
        results: list[Scrape] = [Scrape(u) for u in self.urls]
        async with httpx.AsyncClient(timeout=self.timeout) as client:

            async def one(i: int, url: str) -> None:
                try:
                    response = await client.get(url)
                    response.raise_for_status()
                    results[i] = Scrape(url, await anyio.to_thread.run_sync(parse,
                                                                            response.text))
                except Exception as exc:  # one bad service must not cost the others
                    results[i] = Scrape(url, error=f"{type(exc).__name__}: {exc}")

            async with anyio.create_task_group() as tg:
                for i, url in enumerate(self.urls):
                    tg.start_soon(one, i, url)
        return results


def merge(scrapes: Iterable[Scrape]) -> list[Metric]:
    """One family per name over every service that answered, with equal samples summed."""
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
    """A prometheus_client collector of fixed families, used to render merged ones."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
