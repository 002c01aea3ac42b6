"""Per-expert series: compute latency and routed token rows, by layer, expert and rank.

They are recorded wherever an `ExpertBank` runs, in an expert service or in the attention
service with the `local` backend, for every layer call, whether or not tracing is on.

A decode step observes every expert it routes to in every layer: hundreds of observations.
Through prometheus_client's histograms, which take a lock and several calls each, that cost
about 5% of a batch-16 decode step on the CPU. So each rank keeps plain per-layer lists
instead, and renders them as the same two metric families when /metrics is read
(`_Collector`).

`ExpertBank.forward` times each local expert of every layer call: the grouped GEMM reports
each expert's start and end, or on the CPU each expert's share of the call. The series are
`switchyard:expert_compute_seconds` and `switchyard:expert_tokens_total`; the gateway's
balancedness and the dashboard's per-rank rows come from the latter.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import REGISTRY, CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

# Per-expert FFN times run from ~10 us (one token on a GPU) to ~0.1 s (a CPU prefill).
EXPERT_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                  0.1, 0.25, 1.0)
_LABELS = ["layer", "expert", "rank"]
_COMPUTE = "switchyard:expert_compute_seconds"
_TOKENS = "switchyard:expert_tokens"


@dataclass
class _Layer:
    """One layer's series of one rank for one set of its experts (a placement's share),
    by the local index of its experts."""

    experts: list[int]
    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    buckets: list[list[int]] = field(default_factory=list)  # per expert, non-cumulative

    def __post_init__(self) -> None:
        n = len(self.experts)
        self.tokens, self.seconds = [0] * n, [0.0] * n
        self.buckets = [[0] * (len(EXPERT_BUCKETS) + 1) for _ in range(n)]


class ExpertMetrics:
    """The series of one expert rank."""

    def __init__(self, rank: int) -> None:
        self.rank = str(rank)
        self._layers: dict[int, _Layer] = {}  # per layer, the share observed last
        self._shares: dict[tuple[int, tuple[int, ...]], _Layer] = {}  # every share seen
        _collector.add(self)

    def observe(self, layer: int, experts: list[int], tokens_per_expert: list[int],
                spans: list[tuple[int, int]]) -> None:
        """Record one layer call: `spans[i]` is expert i's (start, end) wall-clock ns."""
        series = self._layers.get(layer)
        if series is None or series.experts is not experts:  # a bank's lists are fixed;
            key = (layer, tuple(experts))  # a rebalanced placement's bank has its own
            if (series := self._shares.get(key)) is None:
                series = self._shares[key] = _Layer(experts)
            self._layers[layer] = series
        tokens, seconds, buckets = series.tokens, series.seconds, series.buckets
        for i, (count, (t0, t1)) in enumerate(zip(tokens_per_expert, spans, strict=True)):
            if count:
                s = (t1 - t0) / 1e9
                tokens[i] += count
                seconds[i] += s
                buckets[i][bisect.bisect_left(EXPERT_BUCKETS, s)] += 1  # le: s <= bound

    def samples(self) -> Iterator[tuple[tuple[str, str, str], int, float, list[int]]]:
        """Each expert that ran: its labels, tokens, seconds and non-cumulative buckets,
        over every share of the placements it was in."""
        merged: dict[tuple[int, int], tuple[int, float, list[int]]] = {}
        for (layer, _), series in list(self._shares.items()):
            for i, expert in enumerate(series.experts):
                if any(series.buckets[i]):
                    t, s, b = merged.get((layer, expert), (0, 0.0, [0] * len(series.buckets[i])))
                    merged[layer, expert] = (t + series.tokens[i], s + series.seconds[i],
                                             [x + y for x, y in zip(b, series.buckets[i],
                                                                    strict=True)])
        for (layer, expert), (tokens, seconds, buckets) in sorted(merged.items()):
            yield (str(layer), str(expert), self.rank), tokens, seconds, buckets


class _Collector(Collector):
    """Every live `ExpertMetrics` of this process as `switchyard:expert_compute_seconds`
    (histogram) and `switchyard:expert_tokens` (counter); ranks that share labels add up."""

    def __init__(self) -> None:
        self._ranks: weakref.WeakSet[ExpertMetrics] = weakref.WeakSet()
        self._lock = threading.Lock()

    def add(self, metrics: ExpertMetrics) -> None:
        with self._lock:
            self._ranks.add(metrics)

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        merged: dict[tuple[str, str, str], tuple[int, float, list[int]]] = {}
        with self._lock:
            ranks = list(self._ranks)
        for rank in ranks:
            for labels, tokens, seconds, buckets in rank.samples():
                if labels in merged:
                    t, s, b = merged[labels]
                    tokens, seconds = tokens + t, seconds + s
                    buckets = [x + y for x, y in zip(buckets, b, strict=True)]
                merged[labels] = (tokens, seconds, buckets)
        compute = HistogramMetricFamily(
            _COMPUTE, "One expert's FFN (gate/up, SwiGLU, down) for one layer call.",
            labels=_LABELS)
        routed = CounterMetricFamily(_TOKENS, "Token rows computed by one expert.",
                                     labels=_LABELS)
        for labels, (tokens, seconds, buckets) in sorted(merged.items()):
            cumulative, running = [], 0
            for bound, n in zip((*map(str, EXPERT_BUCKETS), "+Inf"), buckets, strict=True):
                running += n
                cumulative.append((bound, running))
            compute.add_metric(list(labels), cumulative, seconds)
            routed.add_metric(list(labels), tokens)
        yield compute
        yield routed

    def describe(self) -> list:
        return []  # collected only on a read, never at registration


_collector = _Collector()
REGISTRY.register(_collector)
