"""Per-expert and per-stage latency histograms over a recent window, from service scrapes
(and speculation's counters, windowed the same way).

Each service's cumulative series are turned into increases series by series, as
Prometheus' `increase()` does (a series whose counts went down restarted: everything it
holds is new), and the increases of every service are added into running totals that
only grow. A window is the totals now minus the totals kept from at least that long ago;
a service whose scrape failed adds nothing until it answers again, and then adds all it
counted meanwhile.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.metrics_core import Metric

from gateway.service_metrics import Scrape

EXPERT_COMPUTE = "switchyard:expert_compute_seconds"
EXPERT_TOKENS = "switchyard:expert_tokens"
STAGES = {"dispatch": "switchyard:dispatch_seconds", "combine": "switchyard:combine_seconds"}
# vLLM's speculation counters, as the attention services export them: kept as counts
# (a Hist's `tokens`) under ("speculation", name), windowed as everything else is
SPECULATION = {name: f"switchyard:spec_decode_num_{metric}" for name, metric in (
    ("drafts", "drafts"), ("draft_tokens", "draft_tokens"), ("accepted", "accepted_tokens"))}
MAX_WINDOW_S = 900.0
KEEP_EVERY_S = 10.0  # totals are kept this far apart: at most 91 copies for 900 s
# ("expert", layer, expert), ("rank", layer, rank): its tokens, ("dispatch" | "combine",
# backend), or ("speculation", name): a counter's count
Key = tuple[str, ...]


@dataclass(frozen=True)
class Hist:
    """A cumulative histogram (bucket counts at `bounds`, the last +Inf), its sum of
    observations, and (for experts) a token count."""

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
        n = self.counts[-1]
        return {"calls": n, "tokens": self.tokens, "p50_s": self.quantile(0.5),
                "p99_s": self.quantile(0.99), "mean_s": self.total_s / n if n else None}


@dataclass
class _Sums:
    buckets: dict[float, float] = field(default_factory=lambda: defaultdict(float))
    total_s: float = 0.0
    tokens: float = 0.0


def _expert(labels: dict[str, str]) -> Key:
    return ("expert", labels["layer"], labels["expert"])


def histograms(families: list[Metric]) -> tuple[dict[Key, Hist], dict[Key, set[str]]]:
    """One service's per-expert and per-stage histograms, and the ranks of each expert."""
    by_name = {f.name: f for f in families}
    sums: dict[Key, _Sums] = defaultdict(_Sums)
    ranks: dict[Key, set[str]] = defaultdict(set)
    sources: list[tuple[str, Callable[[dict[str, str]], Key]]] = [
        (EXPERT_COMPUTE, _expert),
        *((name, lambda labels, stage=stage: (stage, labels["backend"]))
          for stage, name in STAGES.items())]
    for name, key_of in sources:
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
    for key, name in SPECULATION.items():
        for s in by_name[name].samples if name in by_name else []:
            if s.name.endswith("_total"):
                sums[("speculation", key)].tokens += s.value
    out = {}
    for key, acc in sums.items():
        bounds = tuple(sorted(acc.buckets))
        # (an expert's tokens wait for its histogram)
        if bounds or key[0] in ("rank", "speculation"):
            out[key] = Hist(bounds, tuple(acc.buckets[b] for b in bounds), acc.total_s,
                            acc.tokens)
    return out, ranks


def rank_tokens(families: list[Metric]) -> dict[tuple[int, int], float]:
    """(layer, expert rank) -> the rows its experts computed, from `switchyard:
    expert_tokens` (since each rank started)."""
    out: dict[tuple[int, int], float] = defaultdict(float)
    for family in families:
        if family.name == EXPERT_TOKENS:
            for s in family.samples:
                out[int(s.labels["layer"]), int(s.labels["rank"])] += s.value
    return out


def balance(tokens: dict[tuple[int, int], float]) -> dict[str, object]:
    """How evenly the expert ranks shared the rows: per MoE layer, the mean over the max
    of each rank's rows (1.0: perfectly even; the slowest rank sets a layer's pace), and
    overall the layers' means summed over their maxima summed (vLLM's `balancedness`);
    each rank's rows over every layer. Ranks seen in no layer are not known here."""
    ranks = sorted({r for _, r in tokens})
    layers = sorted({layer for layer, _ in tokens})
    per_layer: dict[str, float] = {}
    mean_sum = max_sum = 0.0
    for layer in layers:
        loads = [tokens.get((layer, r), 0.0) for r in ranks]
        if max(loads) > 0:
            per_layer[str(layer)] = sum(loads) / len(loads) / max(loads)
            mean_sum, max_sum = mean_sum + sum(loads) / len(loads), max_sum + max(loads)
    return {"balancedness": mean_sum / max_sum if max_sum else None,
            "layers": per_layer,
            "ranks": [{"rank": r, "tokens": sum(tokens.get((layer, r), 0.0) for layer in layers)}
                      for r in ranks]}


class ExpertWindow:
    """Running totals over every service's scrapes, and copies of them for windows."""

    def __init__(self) -> None:
        self._last: dict[str, dict[Key, Hist]] = {}  # per service, as last scraped
        self.totals: dict[Key, Hist] = {}
        self.ranks: dict[Key, set[str]] = defaultdict(set)
        self._kept: deque[tuple[float, dict[Key, Hist]]] = deque()

    def absorb(self, scrapes: list[Scrape], now: float) -> None:
        """Add what each answering service counted since its last scrape."""
        for scrape in scrapes:
            if not scrape.up:
                continue
            hists, ranks = histograms(scrape.families)
            last = self._last.get(scrape.url, {})
            for key, h in hists.items():
                increase = h.increase_since(last.get(key))
                total = self.totals.get(key)
                self.totals[key] = increase if total is None else total.plus(increase)
            self._last[scrape.url] = hists
            for key, r in ranks.items():
                self.ranks[key] |= r
        if not self._kept or now - self._kept[-1][0] >= KEEP_EVERY_S:
            self._kept.append((now, dict(self.totals)))  # Hists are shared, not copied
        while len(self._kept) > 1 and self._kept[1][0] <= now - MAX_WINDOW_S:
            self._kept.popleft()

    def recent(self, now: float, window: float) -> tuple[dict[Key, Hist], float | None]:
        """The totals added in the last `window` seconds (at least: from the newest kept
        copy that old), and how long that is; with none that old, everything since the
        services started, and None."""
        older = [(t, totals) for t, totals in self._kept if t <= now - window]
        if not older:
            return dict(self.totals), None
        at, base = older[-1]
        return {k: h.minus(base.get(k)) for k, h in self.totals.items()}, now - at
