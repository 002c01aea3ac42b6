"""`/dashboard` and an expert's own page `/dashboard/expert?layer=L&expert=E`, over a
window of the last 1, 5 or 15 minutes or everything since the services started.

The pages (static files shipped with the package, no CDN) poll their data endpoints.
Each answer is computed from the recorder's readings (`recorder`), in a worker thread:
a window's figures are the differences of the counters and histograms over it, and its
quantiles Prometheus' `histogram_quantile` over the buckets of every rank summed.
"""

from __future__ import annotations

import dataclasses
import math
import time
from functools import partial
from pathlib import Path

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.errors import GatewayError
from gateway.observability.dashboard.charts import CHARTS
from gateway.observability.dashboard.recorder import HISTORY_S, Recorder
from gateway.observability.dashboard.windows import COUNTERS, EMPTY, STAGES, Hist, Key
from gateway.observability.metrics import balance

STATIC = Path(__file__).parent / "static"
SLOWEST = 10
WINDOWS = (60.0, 300.0, 900.0)  # the page's choices, with "since start"


def speculation(recent: dict[Key, Hist]) -> dict[str, float | None]:
    """Speculation over the window: drafts, draft tokens, accepted tokens; the acceptance
    rate (accepted / draft tokens) and the mean accepted length (1 + accepted / drafts:
    the tokens a verify step emits), None without drafts."""
    drafts, tokens, accepted = (recent.get(key, EMPTY).tokens
                                for key in COUNTERS if key[0] == "speculation")
    return {"drafts": drafts, "draft_tokens": tokens, "accepted": accepted,
            "acceptance": accepted / tokens if tokens else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None}


def expert_rows(recorder: Recorder, recent: dict[Key, Hist]) -> list[dict[str, object]]:
    """Each expert's window summary, with the ranks it was computed on, by layer."""
    ranks = recorder.window.ranks
    experts = [{"layer": int(k[1]), "expert": int(k[2]), "ranks": sorted(ranks[k], key=int),
                **h.summary()} for k, h in recent.items() if k[0] == "expert"]
    return sorted(experts, key=lambda e: (e["layer"], e["expert"]))


class Views:
    """The data endpoints' answers, from one recorder."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        # /dashboard/data's answers as of the recorder's last tick, by window: a page
        # polling more often than the recorder reads gets the same bytes again
        self._answers: tuple[int, dict[float | None, bytes]] = (-1, {})

    def overview_json(self, window: float | None) -> bytes:
        ticks, answers = self._answers
        if ticks != self.recorder.ticks:
            ticks, answers = self._answers = (self.recorder.ticks, {})
        if window not in answers:
            answers[window] = msgspec.json.encode(self.overview(window))
        return answers[window]

    def trace_url(self, trace_id: str | None) -> str | None:
        template = self.recorder.settings.trace_url
        return template.replace("{trace_id}", trace_id) if template and trace_id else None

    def overview(self, window: float | None) -> dict[str, object]:
        """Everything /dashboard shows over the window."""
        recorder, sources = self.recorder, self.recorder.sources
        recent, age = recorder.window.recent(time.monotonic(), window)
        since = time.time() - age if age is not None else -math.inf
        experts = expert_rows(recorder, recent)
        slowest = sorted((e for e in experts if e["calls"]),
                         key=lambda e: (-(e["p99_s"] or 0), -(e["mean_s"] or 0)))[:SLOWEST]
        stages = [{"stage": k[0], "backend": k[1], **h.summary()}
                  for k, h in sorted(recent.items()) if k[0] in STAGES]
        info = sources.engine.info
        history = sources.rebalancer.history
        return {
            "model": recorder.settings.model,
            "moe_layers": info.moe_layers if info else [],
            "num_experts": info.num_experts if info else 0,
            "window": window, "window_s": age, "windows": [*WINDOWS, None],
            "interval_s": recorder.interval_s,
            "experts": experts, "slowest": slowest, "stages": stages,
            "balance": balance({(int(k[1]), int(k[2])): h.tokens for k, h in recent.items()
                                if k[0] == "rank"}),
            "speculation": speculation(recent),
            "requests": {name: recent.get(("request", name), EMPTY).summary()
                         for name in ("ttft", "tpot", "e2e")},
            "output_tokens": recent.get(("counter", "output_tokens"), EMPTY).tokens,
            "charts": [dataclasses.asdict(c) for c in CHARTS],
            "points": [p for p in recorder.points if p["t"] > since],  # type: ignore[operator]
            "events": [dataclasses.asdict(e) for e in recorder.events if e.t > since],
            "services": [dataclasses.asdict(s) for s in recorder.services],
            "slowest_requests": [
                {**dataclasses.asdict(r), "trace_url": self.trace_url(r.trace_id)}
                for r in sources.requests.slowest(since, SLOWEST)],
            "tracing_ui": recorder.settings.trace_url is not None,
            "eplb": {"enabled": sources.rebalancer.config.enabled,
                     "last": dataclasses.asdict(history[-1]) if history else None},
        }

    def expert(self, layer: int, expert: int, window: float | None) -> dict[str, object]:
        """One expert over the window: its latency histogram, its load at each tick, and
        the ranks that hold it."""
        recorder, sources = self.recorder, self.recorder.sources
        info = sources.engine.info
        if info is None or layer not in info.moe_layers or not 0 <= expert < info.num_experts:
            raise GatewayError(404, f"no expert {expert} in MoE layer {layer}")
        now = time.monotonic()
        recent, age = recorder.window.recent(now, window)
        key = ("expert", str(layer), str(expert))
        hist = recent.get(key, EMPTY)
        counts = [c - (hist.counts[i - 1] if i else 0.0) for i, c in enumerate(hist.counts)]
        start = now - age if age is not None else -math.inf
        wall = time.time() - now  # monotonic to Unix seconds
        placement = sources.rebalancer.placement
        held = placement["layers"][str(layer)][expert] if placement else None
        return {
            "layer": layer, "expert": expert, "window": window, "window_s": age,
            "windows": [*WINDOWS, None], "interval_s": recorder.interval_s,
            **hist.summary(),
            "buckets": [{"le": b, "count": c} for b, c in zip(hist.bounds, counts, strict=True)],
            "load": [{"t": t + wall, "tokens": h.tokens, "calls": h.counts[-1] if h.counts
                      else 0.0} for t, h in recorder.window.series(key, start)],
            "computed_on": sorted(recorder.window.ranks.get(key, ()), key=int),
            "placement_ranks": held,  # None: the initial placement, before any rebalance
        }


def window_param(request: Request, default: float) -> float | None:
    """?window=SECONDS, or `all` (since start: None); else the default."""
    text = request.query_params.get("window")
    if text == "all":
        return None
    try:
        window = float(text) if text else default
    except ValueError:
        window = math.nan
    if not 0 < window <= HISTORY_S:
        raise GatewayError(400, f"window must be `all` or a number of seconds in (0, "
                                f"{HISTORY_S:g}]", param="window")
    return window


def int_param(request: Request, name: str) -> int:
    try:
        return int(request.query_params[name])
    except (KeyError, ValueError):
        raise GatewayError(400, f"`{name}` must be an integer", param=name) from None


async def dashboard_data(views: Views, request: Request) -> Response:
    """GET /dashboard/data?window=SECONDS|all (default --dashboard-window)."""
    window = window_param(request, views.recorder.settings.window_s)
    async with views.recorder.lock:
        body = await anyio.to_thread.run_sync(views.overview_json, window)
    return Response(body, media_type="application/json")


async def expert_data(views: Views, request: Request) -> Response:
    """GET /dashboard/expert/data?layer=L&expert=E&window=SECONDS|all."""
    window = window_param(request, views.recorder.settings.window_s)
    layer, expert = int_param(request, "layer"), int_param(request, "expert")
    async with views.recorder.lock:
        answer = await anyio.to_thread.run_sync(views.expert, layer, expert, window)
    return Response(msgspec.json.encode(answer), media_type="application/json")


def page(name: str) -> Route:
    async def serve(_: Request) -> Response:
        return FileResponse(STATIC / f"{name}.html")

    return Route("/dashboard" + ("" if name == "dashboard" else f"/{name}"), serve,
                 methods=["GET"])


def dashboard_routes(recorder: Recorder) -> list[Route | Mount]:
    """The pages, their data and their static files."""
    views = Views(recorder)
    return [page("dashboard"), page("expert"),
            Route("/dashboard/data", partial(dashboard_data, views), methods=["GET"]),
            Route("/dashboard/expert/data", partial(expert_data, views), methods=["GET"]),
            Mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard")]
