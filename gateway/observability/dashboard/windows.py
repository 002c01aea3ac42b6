"""Figures over a recent window, from cumulative series: the services' per-expert and
per-stage histograms, the gateway's own request latencies, and counters.

Each source's cumulative series are turned into increases series by series, as
Prometheus' `increase()` does (a series whose counts went down restarted: everything it
holds is new), and the increases of every source are added into running totals that
only grow. A copy of the totals is kept every `history_s / COPIES` seconds (at most
every tick), for the last `history_s` seconds: a window is the totals now minus the
newest copy at least that old. The copies are arrays (`Copy`): about 2 MB each for
DeepSeek-V3's 15k experts. A service whose
scrape failed adds nothing until it answers again, and then adds all it counted
meanwhile.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
from prometheus_client.metrics_core import Metric

from gateway.observability.metrics import EXPERT_TOKENS
from gateway.observability.service_metrics import Scrape

EXPERT_COMPUTE = "switchyard:expert_compute_seconds"

STAGES = {"dispatch": "switchyard:dispatch_seconds", "combine": "switchyard:combine_seconds"}
# The gateway's own latency histograms, kept under ("request", name).
REQUEST = {"ttft": "switchyard:time_to_first_token_seconds",
           "tpot": "switchyard:inter_token_latency_seconds",
           "e2e": "switchyard:e2e_request_latency_seconds"}
# Counters, kept as a Hist's `tokens` under (group, name): the gateway's output tokens and
# finished requests, and speculation's counters as the attention services export them.
COUNTERS = {
    ("counter", "output_tokens"): "switchyard:generation_tokens",
    ("counter", "requests"): "switchyard:request_success",
    ("speculation", "drafts"): "switchyard:spec_decode_num_drafts",
    ("speculation", "draft_tokens"): "switchyard:spec_decode_num_draft_tokens",
    ("speculation", "accepted"): "switchyard:spec_decode_num_accepted_tokens",
}
# ("expert", layer, expert); ("rank", layer, rank) for its tokens; ("dispatch" | "combine",
# backend); ("request", name); or a COUNTERS key
Key = tuple[str, ...]


@dataclass(frozen=True)
class Hist:
    """A cumulative histogram (bucket counts at `bounds`, the last +Inf), its sum of
    observations, and (for experts and counters) a token count."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    total_s: float = 0.0
    tokens: float = 0.0

    def _zip(self, other: Hist, op: Callable[[float, float], float]) -> Hist:
        return Hist(self.bounds, tuple(op(a, b) for a, b in zip(self.counts, other.counts,
                                                                strict=True)),
                    op(self.total_s, other.total_s), op(self.tokens, other.tokens))

    def increase_since(self, last: Hist | None) -> Hist:
        """What was added since `last` of the same series; all of it after a restart."""
        if last is None or last.bounds != self.bounds or \
                any(a < b for a, b in zip(self.counts, last.counts, strict=True)) or \
                self.tokens < last.tokens:
            return self
        return self._zip(last, lambda a, b: a - b)

    def plus(self, other: Hist) -> Hist:
        return other if other.bounds != self.bounds else self._zip(other, lambda a, b: a + b)

    def minus(self, base: Hist | None) -> Hist:
        """The part added after `base`, an earlier value of the same running total."""
        if base is None or base.bounds != self.bounds:
            return self
        return self._zip(base, lambda a, b: max(0.0, a - b))

    def quantile(self, q: float) -> float | None:
        """Prometheus' `histogram_quantile` (promql/quantile.go, bucketQuantile): counts
        forced monotonic, then linear interpolation within the bucket holding rank q * n;
        in the +Inf bucket, the largest finite bound. None where Prometheus gives NaN."""
        if len(self.bounds) < 2 or not math.isinf(self.bounds[-1]):
            return None
        counts = list(self.counts)
        for i in range(1, len(counts)):
            if math.isclose(counts[i], counts[i - 1], rel_tol=1e-12) or \
                    counts[i] < counts[i - 1]:
                counts[i] = counts[i - 1]
        n = counts[-1]
        if n <= 0:
            return None
        rank = q * n
        b = next((i for i, c in enumerate(counts[:-1]) if c >= rank), len(counts) - 1)
        if b == len(counts) - 1:
            return self.bounds[-2]
        if b == 0 and self.bounds[0] <= 0:
            return self.bounds[0]
        start, below = (0.0, 0.0) if b == 0 else (self.bounds[b - 1], counts[b - 1])
        if counts[b] == below:  # q = 0 over an empty first bucket: NaN in Prometheus
            return None
        return start + (self.bounds[b] - start) * (rank - below) / (counts[b] - below)

    def summary(self) -> dict[str, float | None]:
        """Calls, tokens, p50, p99 and mean seconds, as the page shows them."""
        n = self.counts[-1] if self.counts else 0.0
        return {"calls": n, "tokens": self.tokens, "p50_s": self.quantile(0.5),
                "p99_s": self.quantile(0.99), "mean_s": self.total_s / n if n else None}


EMPTY = Hist((), ())


def total(hists: list[Hist]) -> Hist:
    """The sum of histograms with the same buckets (dispatch over every backend)."""
    out = hists[0] if hists else EMPTY
    for h in hists[1:]:
        out = out.plus(h)
    return out


@dataclass
class _Sums:
    buckets: dict[float, float] = field(default_factory=lambda: defaultdict(float))
    total_s: float = 0.0
    tokens: float = 0.0


def _expert(labels: dict[str, str]) -> Key:
    return ("expert", labels["layer"], labels["expert"])


def _sources() -> list[tuple[str, Callable[[dict[str, str]], Key]]]:
    """Each histogram family read, and the key its samples are summed under."""
    return [(EXPERT_COMPUTE, _expert),
            *((name, lambda labels, stage=stage: (stage, labels["backend"]))
              for stage, name in STAGES.items()),
            *((name, lambda _, key=key: ("request", key)) for key, name in REQUEST.items())]


def histograms(families: list[Metric]) -> tuple[dict[Key, Hist], dict[Key, set[str]]]:
    """One source's histograms and counters, and the ranks of each expert."""
    by_name = {f.name: f for f in families}
    sums: dict[Key, _Sums] = defaultdict(_Sums)
    ranks: dict[Key, set[str]] = defaultdict(set)
    for name, key_of in _sources():
        for s in by_name[name].samples if name in by_name else []:
            acc = sums[key_of(s.labels)]
            if s.name.endswith("_bucket"):
                acc.buckets[float(s.labels["le"])] += s.value
            elif s.name.endswith("_sum"):
                acc.total_s += s.value
    for s in by_name[EXPERT_TOKENS].samples if EXPERT_TOKENS in by_name else []:
        sums[_expert(s.labels)].tokens += s.value
        sums[("rank", s.labels["layer"], s.labels["rank"])].tokens += s.value
        ranks[_expert(s.labels)].add(s.labels["rank"])
    for key, name in COUNTERS.items():
        for s in by_name[name].samples if name in by_name else []:
            if s.name.endswith("_total"):
                sums[key].tokens += s.value
    out = {}
    for key, acc in sums.items():
        bounds = tuple(sorted(acc.buckets))
        # (an expert's tokens wait for its histogram)
        if bounds or key[0] != "expert":
            out[key] = Hist(bounds, tuple(acc.buckets[b] for b in bounds), acc.total_s,
                            acc.tokens)
    return out, ranks


COPIES = 90  # kept over the history: a window's start is within history / COPIES
Layout = tuple[float, ...]  # a histogram's bucket bounds; () for a counter


class Copy:
    """The totals at one moment, held compactly: for each bucket layout, one array row
    per key (bucket counts, then the sum and the tokens). A dict of DeepSeek-V3's 15k
    expert histograms takes ten times the memory."""

    def __init__(self, totals: dict[Key, Hist], rows: dict[Layout, dict[Key, int]]) -> None:
        for key, h in totals.items():
            layout = rows.setdefault(h.bounds, {})
            layout.setdefault(key, len(layout))
        self._rows = rows  # (the window's own, which only grows)
        self._arrays: dict[Layout, np.ndarray] = {}
        for bounds, index in rows.items():
            values = np.zeros((len(index), len(bounds) + 2))  # [keys, buckets + 2]
            for key, row in index.items():
                h = totals.get(key)
                if h is not None and h.bounds == bounds:
                    values[row] = (*h.counts, h.total_s, h.tokens)
            self._arrays[bounds] = values

    def get(self, key: Key, bounds: Layout) -> Hist | None:
        """The key's histogram then, if it had one with these bounds."""
        row = self._rows.get(bounds, {}).get(key)
        values = self._arrays.get(bounds)
        if row is None or values is None or row >= len(values):
            return None
        *counts, total_s, tokens = values[row].tolist()
        return Hist(bounds, tuple(counts), total_s, tokens)


class Window:
    """Running totals over every source's scrapes, and copies of them for windows."""

    def __init__(self, history_s: float) -> None:
        self.history_s = history_s
        self._last: dict[str, dict[Key, Hist]] = {}  # per source, as last scraped
        self.totals: dict[Key, Hist] = {}
        self.ranks: dict[Key, set[str]] = defaultdict(set)
        self._rows: dict[Layout, dict[Key, int]] = {}  # each key's row in the copies
        self._kept: deque[tuple[float, Copy]] = deque()  # (monotonic seconds, totals then)
        self._tick: tuple[tuple[float, dict[Key, Hist]], ...] = ()  # the last two ticks'

    def absorb(self, scrapes: list[Scrape], now: float) -> None:
        """Add what each answering source counted since its last scrape, and keep a copy
        of the totals as of `now` if the last is old enough."""
        for scrape in scrapes:
            if not scrape.up:
                continue
            hists, ranks = histograms(scrape.families)
            last = self._last.get(scrape.url, {})
            for key, h in hists.items():
                increase = h.increase_since(last.get(key))
                running = self.totals.get(key)
                self.totals[key] = increase if running is None else running.plus(increase)
            self._last[scrape.url] = hists
            for key, r in ranks.items():
                self.ranks[key] |= r
        self._tick = (*self._tick[-1:], (now, dict(self.totals)))  # (Hists are shared)
        if not self._kept or now - self._kept[-1][0] >= self.history_s / COPIES:
            self._kept.append((now, Copy(self.totals, self._rows)))
        while len(self._kept) > 1 and self._kept[1][0] <= now - self.history_s:
            self._kept.popleft()

    def recent(self, now: float, window: float | None) -> tuple[dict[Key, Hist], float | None]:
        """The totals added in the last `window` seconds (at least: from the newest copy
        that old), and how long that is; with no copy that old, or `window` None,
        everything since the services started, and None."""
        older = [(t, copy) for t, copy in self._kept if window is not None and t <= now - window]
        if not older:
            return dict(self.totals), None
        at, base = older[-1]
        return {k: h.minus(base.get(k, h.bounds)) for k, h in self.totals.items()}, now - at

    def last_tick(self) -> tuple[dict[Key, Hist], float]:
        """What the last tick added, and the seconds since the tick before (0 at first)."""
        if len(self._tick) < 2:
            return {}, 0.0
        (before, base), (at, now) = self._tick
        return {k: h.minus(base.get(k)) for k, h in now.items()}, at - before

    def series(self, key: Key, since: float) -> list[tuple[float, Hist]]:
        """(monotonic time, what was added since the copy before) for one key, for the
        copies after `since`."""
        if key not in self.totals:
            return []
        bounds = self.totals[key].bounds
        out = []
        for (_, base), (at, now) in pairwise(self._kept):
            if at > since and (h := now.get(key, bounds)) is not None:
                out.append((at, h.minus(base.get(key, bounds))))
        return out
