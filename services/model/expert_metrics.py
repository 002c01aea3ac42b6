"""Per-expert series: compute latency and routed token rows, by layer, expert and rank.

Recorded wherever an `ExpertBank` runs (an expert service, or the attention service with
the `local` backend), for every layer call, whether or not tracing is on.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

# Per-expert FFN times run from ~10 us (one token on a GPU) to ~0.1 s (a CPU prefill).
EXPERT_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                  0.1, 0.25, 1.0)
_LABELS = ["layer", "expert", "rank"]
_COMPUTE = Histogram("switchyard:expert_compute_seconds",
                     "One expert's FFN (gate/up, SwiGLU, down) for one layer call.", _LABELS,
                     buckets=EXPERT_BUCKETS)
_TOKENS = Counter("switchyard:expert_tokens", "Token rows computed by one expert.", _LABELS)


class ExpertMetrics:
    """The series of one expert rank; children are cached, as a step observes hundreds."""

    def __init__(self, rank: int) -> None:
        self.rank = str(rank)
        self._children: dict[tuple[int, int], tuple[Histogram, Counter]] = {}

    def observe(self, layer: int, experts: list[int], tokens_per_expert: list[int],
                spans: list[tuple[int, int]]) -> None:
        """Record one layer call: `spans[i]` is expert i's (start, end) wall-clock ns."""
        for expert, count, (t0, t1) in zip(experts, tokens_per_expert, spans, strict=True):
            if count:
                compute, tokens = self._child(layer, expert)
                compute.observe((t1 - t0) / 1e9)
                tokens.inc(count)

    def _child(self, layer: int, expert: int) -> tuple[Histogram, Counter]:
        key = (layer, expert)
        if key not in self._children:
            labels = (str(layer), str(expert), self.rank)
            self._children[key] = (_COMPUTE.labels(*labels), _TOKENS.labels(*labels))
        return self._children[key]
