"""Prometheus metrics: the series that vLLM's operators already graph, under `switchyard:`.

Latencies are observed per choice as its tokens stream through the gateway. Engine-side
timings, for queueing and prefill, arrive on the first token's delta. Gauges of the
engine's state are read from the engine when scraped. They are absent while the engine
does not answer, so they are never stale.
"""

from __future__ import annotations

import time
from collections import defaultdict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from common.messages import EngineStats, TokenDelta
from gateway.observability.service_metrics import Families, Scrape, merge
from gateway.routing.rebalancer import RebalanceRecord

# vLLM's buckets, so dashboards built for it read ours the same way.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
_REBALANCE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

EXPERT_TOKENS = "switchyard:expert_tokens"


def rank_tokens(families: list[Metric]) -> dict[tuple[int, int], float]:
    """Map (layer, expert rank) to the rows its experts computed since the rank started.

    The counts come from `switchyard:expert_tokens`.
    """
    out: dict[tuple[int, int], float] = defaultdict(float)
    for family in families:
        if family.name == EXPERT_TOKENS:
            for s in family.samples:
                out[int(s.labels["layer"]), int(s.labels["rank"])] += s.value
    return out


def balance(tokens: dict[tuple[int, int], float]) -> dict[str, object]:
    """How evenly the expert ranks shared the rows.

    Per MoE layer, this is the mean of the ranks' rows over their maximum. 1.0 is
    perfectly even, and the slowest rank sets a layer's pace. Overall, `balancedness` is
    the sum of the layers' means over the sum of their maxima, as in vLLM. The result also
    gives each rank's rows over every layer. Ranks seen in no layer are not known here.
    """
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


class Metrics:
    """Every series of one gateway, in its own registry, labelled with the model name."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self._model = model_name
        self.running = Gauge("switchyard:num_requests_running",
                             "Requests in the engine's running batch.", m, registry=r)
        self.waiting = Gauge("switchyard:num_requests_waiting",
                             "Requests waiting to be scheduled.", m, registry=r)
        self.kv_usage = Gauge("switchyard:kv_cache_usage_perc",
                              "Fraction of KV-cache blocks in use (1 = full).", m, registry=r)
        self.prompt_tokens = Counter("switchyard:prompt_tokens",
                                     "Prompt tokens of accepted requests.", m, registry=r)
        self.generation_tokens = Counter("switchyard:generation_tokens",
                                         "Generated tokens.", m, registry=r)
        # As in vLLM: prompt tokens looked up in the prefix cache, and those found there
        self.prefix_cache_queries = Counter(
            "switchyard:prefix_cache_queries",
            "Prompt tokens of requests looked up in the prefix cache.", m, registry=r)
        self.prefix_cache_hits = Counter(
            "switchyard:prefix_cache_hits",
            "Prompt tokens whose KV was found in the prefix cache.", m, registry=r)
        self.finished = Counter("switchyard:request_success", "Finished choices.",
                                [*m, "finished_reason"], registry=r)
        self.rejected = Counter("switchyard:request_rejected",
                                "Requests refused because the queue was full.", m, registry=r)
        self.service_up = Gauge("switchyard:service_up",
                                "1 if a service's /metrics answered the last scrape.",
                                [*m, "service"], registry=r)
        self.balancedness = Gauge(
            "switchyard:expert_balancedness",
            "Expert ranks' rows since they started, mean over max: per MoE layer, and "
            "overall (layer=\"all\": the layers' means summed over their maxima summed).",
            [*m, "layer"], registry=r)

        self.rebalances = Counter("switchyard:eplb_rebalances",
                                  "Expert rebalances (EPLB) while serving, by outcome.",
                                  [*m, "outcome"], registry=r)
        self.placement_version = Gauge("switchyard:eplb_placement_version",
                                       "The placement version the experts last moved to.",
                                       m, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _REQUEST_BUCKETS
                      ) -> Histogram:
            return Histogram(f"switchyard:{name}_seconds", doc, m, buckets=buckets,
                             registry=r)

        self.ttft = histogram("time_to_first_token", "Arrival to first token.", _TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency", "Time between tokens.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency", "Arrival to last token.")
        self.queue = histogram("request_queue_time", "Time waiting to be scheduled.")
        self.prefill = histogram("request_prefill_time", "First scheduled to first token.")
        self.decode = histogram("request_decode_time", "First token to last token.")
        self.rebalance_time = histogram("eplb_rebalance", "One rebalance: the expert ranks' "
                                        "load and every group's switch.", _REBALANCE_BUCKETS)

    def rebalanced(self, record: RebalanceRecord) -> None:
        self.rebalances.labels(self._model, "failed" if record.error else "ok").inc()
        self.rebalance_time.labels(self._model).observe(record.duration_s)
        if not record.error:
            self.placement_version.labels(self._model).set(record.version)

    def render(self, stats: EngineStats | None, scrapes: list[Scrape]) -> bytes:
        """The text exposition.

        It holds the gateway's series, then the services' series merged from `scrapes`.
        The engine gauges come from `stats` when the engine answered.
        """
        engine_gauges = (self.running, self.waiting, self.kv_usage)
        # The engine did not answer. Show no reading rather than an old one.
        if stats is None:
            for gauge in engine_gauges:
                gauge.clear()
        else:
            self.running.labels(self._model).set(stats.num_running)
            self.waiting.labels(self._model).set(stats.num_waiting)
            self.kv_usage.labels(self._model).set(stats.kv_blocks_used
                                                  / max(stats.num_kv_blocks, 1))
        for scrape in scrapes:
            self.service_up.labels(self._model, scrape.url).set(int(scrape.up))
        self._balance([f for s in scrapes if s.up for f in s.families])
        return generate_latest(self.registry) + generate_latest(Families(merge(scrapes)))


    def _balance(self, families: list[Metric]) -> None:
        load = balance(rank_tokens(families))
        self.balancedness.clear()
        for layer, value in load["layers"].items():  # type: ignore[attr-defined]
            self.balancedness.labels(self._model, layer).set(value)
        if load["balancedness"] is not None:
            self.balancedness.labels(self._model, "all").set(load["balancedness"])


class RequestTimer:
    """Observes one choice's latencies as its engine deltas arrive."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics
        self._start = self._last = time.monotonic()
        self._first: float | None = None
        self._done = False
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.e2e_s: float | None = None  # from arrival to the end, once finished
        self.num_cached_tokens: int | None = None  # from the engine, with the first token

    def on_delta(self, delta: TokenDelta, arrived: float | None = None) -> None:
        """Observe one engine delta.

        `arrived` is when the delta came from the engine, in time.monotonic(), if that was
        earlier than now. A client that reads slowly must not lengthen the engine's
        latencies.
        """
        m, model = self._m, self._m._model
        now = time.monotonic() if arrived is None else arrived
        if delta.token_ids:
            self.num_tokens += len(delta.token_ids)
            m.generation_tokens.labels(model).inc(len(delta.token_ids))
            if self._first is None:
                self._first = now
                m.ttft.labels(model).observe(now - self._start)
            else:
                m.itl.labels(model).observe(now - self._last)
            self._last = now
        if delta.queue_time_s is not None:
            m.queue.labels(model).observe(delta.queue_time_s)
        if delta.prefill_time_s is not None:
            m.prefill.labels(model).observe(delta.prefill_time_s)
        if delta.num_cached_tokens is not None:
            self.num_cached_tokens = delta.num_cached_tokens
            m.prefix_cache_queries.labels(model).inc(delta.num_prompt_tokens)
            m.prefix_cache_hits.labels(model).inc(delta.num_cached_tokens)
        if delta.finish_reason is not None:
            self.finish(delta.finish_reason, now)

    @property
    def ttft_s(self) -> float | None:
        return None if self._first is None else self._first - self._start

    def finish(self, reason: str, at: float | None = None) -> None:
        """Count the choice as ended, with its end-to-end and decode time.

        This counts only once. The end is at `at`, or else now.
        """
        if self._done:
            return
        self._done = True
        self.finish_reason = reason
        m, model = self._m, self._m._model
        now = time.monotonic() if at is None else at
        m.finished.labels(model, reason).inc()
        self.e2e_s = now - self._start
        m.e2e.labels(model).observe(self.e2e_s)
        if self._first is not None:
            m.decode.labels(model).observe(self._last - self._first)
