"""The services' expositions as `gateway.observability.service_metrics.parse` reads them:
the same families as prometheus_client's own parser, which is the reference, for what
prometheus_client writes (every metric type, escaped label values and help, NaN and
infinities); text it does not expect goes to that parser."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.service_metrics import PREFIX, parse


def reference(text: str) -> list[Metric]:
    return [f for f in text_string_to_metric_families(text)
            if f.name.startswith(PREFIX) and not f.name.endswith("_created")]


def described(families: list[Metric]) -> list[tuple]:
    return [(f.name, f.type, f.documentation,
             [(s.name, s.labels, repr(s.value)) for s in f.samples]) for f in families]


def test_what_prometheus_client_writes_reads_as_its_own_parser_reads_it() -> None:
    registry = CollectorRegistry()
    counter = Counter("switchyard:requests", 'help with a \\ and\na "newline"', ["x"],
                      registry=registry)
    counter.labels('quote " backslash \\ newline \n').inc(3)
    counter.labels("plain").inc()
    histogram = Histogram("switchyard:step_seconds", "a histogram", ["layer"],
                          registry=registry, buckets=(0.1, 1.0))
    histogram.labels("1").observe(0.5)
    histogram.labels("2").observe(7.0)
    Gauge("switchyard:nan", "not a number", registry=registry).set(float("nan"))
    Gauge("switchyard:inf", "infinite", registry=registry).set(float("-inf"))
    Gauge("other_metric", "not ours", registry=registry).set(1)
    text = generate_latest(registry).decode()
    assert described(parse(text)) == described(reference(text))
    assert {f.name for f in parse(text)} == {"switchyard:requests", "switchyard:step_seconds",
                                             "switchyard:nan", "switchyard:inf"}


def test_text_it_does_not_expect_goes_to_prometheus_clients_parser() -> None:
    text = ("# TYPE switchyard:x gauge\n"
            "switchyard:x{a=\"1\"} 2.5 1700000000000\n")  # (a timestamp)
    assert described(parse(text)) == described(reference(text))
