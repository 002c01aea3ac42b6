"""`/dashboard`: per-expert latency and load over a recent window, the expert ranks' load
and balancedness, the last expert rebalance, speculation's acceptance, per-service health
and busy share.

The page (static files shipped with the package, no CDN) polls `/dashboard/data`. Each
poll uses the services' latest scrape (`gateway.service_metrics`, shared with `/metrics`)
and `gateway.expert_stats` turns the scrapes into windowed histograms, in a worker thread.
Quantiles are Prometheus' `histogram_quantile` over the buckets of every rank summed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from functools import partial
from pathlib import Path

import anyio
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.errors import GatewayError
from gateway.expert_stats import MAX_WINDOW_S, STAGES, ExpertWindow, balance
from gateway.service_metrics import Scrape
from gateway.serving import Serving, json_response

STATIC = Path(__file__).parent / "static"
SLOWEST = 10
BUSY = "switchyard:busy_fraction"
# vLLM's speculation counters, as the attention services export them
DRAFTS, DRAFT_TOKENS, ACCEPTED = (f"switchyard:spec_decode_num_{name}" for name in (
    "drafts", "draft_tokens", "accepted_tokens"))


class SpeculationWindow:
    """Speculation's acceptance over a recent window: the counters' totals over the
    attention services at each poll, kept for `MAX_WINDOW_S`; a window's figures are the
    differences from the oldest poll inside it (as Prometheus' `increase()`), or from
    zero while the window reaches back past the first poll (everything since start)."""

    def __init__(self) -> None:
        self._polls: deque[tuple[float, dict[str, float]]] = deque()
        self._trimmed = False  # polls dropped: the first kept is not the start

    def observe(self, scrapes: list[Scrape], now: float) -> None:
        totals = dict.fromkeys((DRAFTS, DRAFT_TOKENS, ACCEPTED), 0.0)
        for scrape in scrapes:
            for family in scrape.families:
                if family.name in totals:
                    totals[family.name] += sum(s.value for s in family.samples
                                               if s.name.endswith("_total"))
        self._polls.append((now, totals))
        while self._polls[0][0] < now - MAX_WINDOW_S:
            self._polls.popleft()
            self._trimmed = True

    def summary(self, now: float, window: float) -> dict[str, float | None]:
        """Drafts, draft tokens and accepted tokens in the window; the acceptance rate
        (accepted / draft tokens) and mean accepted length (1 + accepted / drafts: the
        tokens a verify step emits), None without drafts."""
        if not self._polls:
            return {"drafts": 0, "draft_tokens": 0, "accepted": 0, "acceptance": None,
                    "mean_accepted_length": None}
        start, last = self._polls[0][0], self._polls[-1][1]
        first = dict.fromkeys(last, 0.0) if start >= now - window and not self._trimmed \
            else next(t for at, t in self._polls if at >= now - window)
        drafts, tokens, accepted = (last[k] - first[k] for k in (DRAFTS, DRAFT_TOKENS,
                                                                 ACCEPTED))
        return {"drafts": drafts, "draft_tokens": tokens, "accepted": accepted,
                "acceptance": accepted / tokens if tokens else None,
                "mean_accepted_length": 1 + accepted / drafts if drafts else None}


class Dashboard:
    """The window state and the page's data."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.window = ExpertWindow()
        self._lock = anyio.Lock()
        self._absorbed: list[Scrape] | None = None  # the scrape already in the totals
        self.speculation = SpeculationWindow()

    async def data(self, window: float) -> dict[str, object]:
        scrapes = await self.serving.services.scrape()
        async with self._lock:
            stats = await anyio.to_thread.run_sync(self._stats, scrapes, window)
        info = self.serving.engine.info
        return {
            "model": self.serving.config.served_model_name,
            "moe_layers": info.moe_layers if info else [],
            "num_experts": info.num_experts if info else 0,
            **stats,
            "services": [{"url": s.url, "up": s.up, "error": s.error, "busy": busy(s)}
                         for s in scrapes],
            "engines": self.serving.engine.status(),
            "eplb": {"enabled": self.serving.rebalancer.config.enabled,
                     "last": dataclasses.asdict(history[-1]) if (
                         history := self.serving.rebalancer.history) else None},
        }

    def _stats(self, scrapes: list[Scrape], window: float) -> dict[str, object]:
        """Absorb the scrapes (once per scrape) and summarise the window."""
        now = time.monotonic()
        if scrapes is not self._absorbed:
            self.window.absorb(scrapes, now)
            self.speculation.observe(scrapes, now)
            self._absorbed = scrapes
        recent, age = self.window.recent(now, window)
        experts = [{"layer": int(k[1]), "expert": int(k[2]),
                    "ranks": sorted(self.window.ranks[k], key=int), **h.summary()}
                   for k, h in recent.items() if k[0] == "expert"]
        experts.sort(key=lambda e: (e["layer"], e["expert"]))
        slowest = sorted((e for e in experts if e["calls"]),
                         key=lambda e: (-(e["p99_s"] or 0), -(e["mean_s"] or 0)))[:SLOWEST]
        stages = [{"stage": k[0], "backend": k[1], **h.summary()}
                  for k, h in sorted(recent.items()) if k[0] in STAGES]
        load = balance({(int(k[1]), int(k[2])): h.tokens for k, h in recent.items()
                        if k[0] == "rank"})
        # window_s None: everything since the services started
        return {"window_s": age, "experts": experts, "slowest": slowest, "stages": stages,
                "balance": load, "speculation": self.speculation.summary(now, window)}


def busy(scrape: Scrape) -> dict[str, float]:
    """A service's busy share of its last seconds, per compute thread (`service` label:
    attention, expert), from its `switchyard:busy_fraction`: both sides of a ping-pong
    pipeline busy at once is what disaggregation is for."""
    return {sample.labels.get("service", ""): sample.value for family in scrape.families
            if family.name == BUSY for sample in family.samples}


async def dashboard_page(_: Request) -> Response:
    """GET /dashboard: the page itself."""
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
    """The page, its data and its static files."""
    dashboard = Dashboard(serving)
    return [Route("/dashboard", dashboard_page, methods=["GET"]),
            Route("/dashboard/data", partial(dashboard_data, dashboard), methods=["GET"]),
            Mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard")]
