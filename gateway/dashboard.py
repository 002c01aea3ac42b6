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
from functools import partial
from pathlib import Path

import anyio
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.errors import GatewayError
from gateway.expert_stats import (
    MAX_WINDOW_S,
    SPECULATION,
    STAGES,
    ExpertWindow,
    Hist,
    Key,
    balance,
)
from gateway.service_metrics import Scrape
from gateway.serving import Serving, json_response

STATIC = Path(__file__).parent / "static"
SLOWEST = 10
BUSY = "switchyard:busy_fraction"


def speculation(recent: dict[Key, Hist]) -> dict[str, float | None]:
    """Speculation over the window (`expert_stats.SPECULATION`'s counters): drafts, draft
    tokens, accepted tokens; the acceptance rate (accepted / draft tokens) and the mean
    accepted length (1 + accepted / drafts: the tokens a verify step emits), None
    without drafts."""
    drafts, tokens, accepted = (recent[("speculation", name)].tokens
                                if ("speculation", name) in recent else 0.0
                                for name in SPECULATION)
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
                "balance": load, "speculation": speculation(recent)}


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
