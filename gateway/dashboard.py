"""`/dashboard`: per-expert latency and load over a recent window, per-service health.

The page (static files shipped with the package, no CDN) polls `/dashboard/data`, which
scrapes the services' `/metrics` now and subtracts an earlier scrape, as Prometheus'
`increase()` would: the window runs from the newest kept scrape at least `window`
seconds old, or from the services' start when there is none yet. Quantiles are
Prometheus' `histogram_quantile` over the summed buckets of every rank.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from prometheus_client.metrics_core import Metric
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.errors import GatewayError
from gateway.service_metrics import merge
from gateway.serving import Serving, json_response

STATIC = Path(__file__).parent / "static"
MAX_WINDOW_S = 3600.0
SLOWEST = 10
EXPERT_COMPUTE = "switchyard:expert_compute_seconds"
EXPERT_TOKENS = "switchyard:expert_tokens"
STAGES = {"dispatch": "switchyard:dispatch_seconds", "combine": "switchyard:combine_seconds"}


@dataclass(frozen=True)
class Hist:
    """A cumulative histogram (bucket counts at `bounds`, the last +Inf), and a token count."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    total_s: float = 0.0
    tokens: float = 0.0

    def since(self, base: Hist | None) -> Hist:
        """The increase since `base`; a service restart (counts went down) resets it."""
        if base is None or base.bounds != self.bounds or self.counts[-1] < base.counts[-1]:
            return self
        return Hist(self.bounds, tuple(a - b for a, b in zip(self.counts, base.counts,
                                                              strict=True)),
                    self.total_s - base.total_s, self.tokens - base.tokens)

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket holding rank q * n."""
        n = self.counts[-1]
        if n <= 0:
            return None
        rank = q * n
        i = next(i for i, c in enumerate(self.counts) if c >= rank)
        if math.isinf(self.bounds[i]):
            return self.bounds[-2]
        lower, below = (0.0, 0.0) if i == 0 else (self.bounds[i - 1], self.counts[i - 1])
        return lower + (self.bounds[i] - lower) * (rank - below) / (self.counts[i] - below)

    def summary(self) -> dict[str, float | None]:
        n = self.counts[-1]
        return {"calls": n, "tokens": self.tokens, "p50_s": self.quantile(0.5),
                "p99_s": self.quantile(0.99), "mean_s": self.total_s / n if n else None}


Key = tuple[str, ...]  # ("expert", layer, expert) or ("dispatch" | "combine", backend)


@dataclass
class _Sums:
    buckets: dict[float, float] = field(default_factory=lambda: defaultdict(float))
    total_s: float = 0.0
    tokens: float = 0.0


def _expert(labels: dict[str, str]) -> Key:
    return ("expert", labels["layer"], labels["expert"])


def histograms(families: list[Metric]) -> tuple[dict[Key, Hist], dict[Key, set[str]]]:
    """Per-expert and per-stage histograms (ranks summed), and the ranks of each expert."""
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
        ranks[_expert(s.labels)].add(s.labels["rank"])
    out = {}
    for key, acc in sums.items():
        bounds = tuple(sorted(acc.buckets))
        if bounds:  # a token count without its histogram is skipped until both arrive
            out[key] = Hist(bounds, tuple(acc.buckets[b] for b in bounds), acc.total_s,
                            acc.tokens)
    return out, ranks


class Dashboard:
    """The scrapes kept for windows, and the page's data."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self._history: deque[tuple[float, dict[Key, Hist]]] = deque()

    def _baseline(self, now: float, window: float) -> tuple[dict[Key, Hist], float | None]:
        """The newest kept scrape at least `window` old (and its age), else nothing."""
        older = [(t, h) for t, h in self._history if t <= now - window]
        while len(self._history) > 1 and self._history[1][0] <= now - MAX_WINDOW_S:
            self._history.popleft()  # keep one scrape older than the longest window
        return (older[-1][1], now - older[-1][0]) if older else ({}, None)

    async def data(self, window: float) -> dict[str, object]:
        serving = self.serving
        info = serving.engine.info
        scrapes = await serving.services.scrape()
        current, ranks = histograms(merge(scrapes))
        now = time.monotonic()
        base, age = self._baseline(now, window)
        self._history.append((now, current))
        recent = {k: h.since(base.get(k)) for k, h in current.items()}
        experts = [{"layer": int(k[1]), "expert": int(k[2]), "ranks": sorted(ranks[k]),
                    **h.summary()} for k, h in recent.items() if k[0] == "expert"]
        experts.sort(key=lambda e: (e["layer"], e["expert"]))
        slowest = sorted((e for e in experts if e["calls"]),
                         key=lambda e: (-(e["p99_s"] or 0), -(e["mean_s"] or 0)))[:SLOWEST]
        stages = [{"stage": k[0], "backend": k[1], **h.summary()}
                  for k, h in sorted(recent.items()) if k[0] in STAGES]
        return {
            "model": serving.config.served_model_name,
            "window_s": age,  # None: since the services started
            "moe_layers": info.moe_layers if info else [],
            "num_experts": info.num_experts if info else 0,
            "experts": experts, "slowest": slowest, "stages": stages,
            "services": [{"url": s.url, "up": s.up, "error": s.error} for s in scrapes],
            "engines": serving.engine.status(),
        }


async def dashboard_page(_: Request) -> Response:
    return FileResponse(STATIC / "dashboard.html")


async def dashboard_data(dashboard: Dashboard, request: Request) -> Response:
    """GET /dashboard/data?window=SECONDS (default --dashboard-window)."""
    text = request.query_params.get("window")
    try:
        window = float(text) if text else dashboard.serving.config.dashboard_window_s
    except ValueError:
        window = math.nan
    if not 0 < window <= MAX_WINDOW_S:
        raise GatewayError(400, f"window must be a number of seconds in (0, {MAX_WINDOW_S:g}]",
                           param="window")
    return json_response(await dashboard.data(window))


def dashboard_routes(serving: Serving) -> list[Route | Mount]:
    dashboard = Dashboard(serving)
    return [Route("/dashboard", dashboard_page, methods=["GET"]),
            Route("/dashboard/data", partial(dashboard_data, dashboard), methods=["GET"]),
            Mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard")]
