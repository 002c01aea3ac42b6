"""The gateway's Starlette application: OpenAI-compatible routes over the engine client."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import anyio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from common import tracing
from gateway.access import KeyAuth
from gateway.chat import create_chat_completion
from gateway.completions import create_completion
from gateway.config import DASHBOARD_HISTORY_S, GatewayConfig
from gateway.dashboard.page import dashboard_routes
from gateway.dashboard.recorder import Recorder
from gateway.engine_pool import EnginePool
from gateway.errors import (
    GatewayError,
    engine_unavailable,
    handle_gateway_error,
    handle_http_exception,
    handle_unexpected,
)
from gateway.openai_protocol import ModelCard, ModelList
from gateway.openapi import openapi_json
from gateway.serving import Serving, json_response
from gateway.tokenization import detokenize, tokenize
from gateway.tokenizer import Tokenizer
from gateway.version import show_version

HEALTH_TIMEOUT_S = 5.0


async def list_models(serving: Serving, _: Request) -> Response:
    """GET /v1/models: the one served model, with its context length once known."""
    config = serving.config
    card = ModelCard(
        id=config.served_model_name,
        created=int(time.time()),
        max_model_len=serving.max_model_len(serving.engine.info),
        quantization=serving.engine.info.quantization if serving.engine.info else None,
        root=str(config.model_dir),
    )
    return json_response(ModelList([card]))


async def health(serving: Serving, _: Request) -> Response:
    """GET /health: 200 once every attention group is connected and its warm-up generation
    went through every expert rank, while each answers; the body lists each backing
    service. A 503 says why not (a failed warm-up's error)."""
    if not serving.engine.all_connected:
        return engine_unavailable("not connected to every attention service").response()
    if problem := serving.engine.warmup_problem():
        return engine_unavailable(problem).response()
    try:  # alive, not only connected
        groups = await serving.engine.group_stats(timeout=HEALTH_TIMEOUT_S)
    except GatewayError as exc:
        return exc.response()
    if not all(s.experts_ready for s in groups):
        return engine_unavailable("an expert service is unreachable").response()
    return json_response({"status": "ok", "attention": serving.engine.status(groups)})


async def metrics(serving: Serving, _: Request) -> Response:
    """GET /metrics: Prometheus text format; engine gauges are read now (skipped if down),
    and the services' series (per-expert, dispatch) are scraped now and merged."""
    try:
        stats = await serving.engine.stats() if serving.engine.all_connected else None
    except GatewayError:
        stats = None
    scrapes = await serving.services.scrape(fresh=True)
    body = await anyio.to_thread.run_sync(serving.metrics.render, stats, scrapes)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def eplb(serving: Serving, _: Request) -> Response:
    """GET /eplb: expert load balancing's settings, the placement the last rebalance
    moved to (None before one), and the last rebalances."""
    rebalancer = serving.rebalancer
    return json_response({"enabled": rebalancer.config.enabled,
                          "interval_steps": rebalancer.config.interval,
                          "window_steps": rebalancer.config.window,
                          "num_redundant_experts": rebalancer.config.num_redundant,
                          "placement": rebalancer.placement,
                          "rebalances": [dataclasses.asdict(r) for r in rebalancer.history]})


async def eplb_rebalance(serving: Serving, request: Request) -> Response:
    """POST /eplb/rebalance: move the experts now, to EPLB's placement of the window's
    load, or to the body's `{"placement": {...}}` (a placement file's JSON). Answers
    the rebalance's record once every group routes by it (an `error` in it: the old
    placement still routes, e.g. one that does not fit the model), or
    `{"rebalance": null}` where it is the one routed by already."""
    rebalancer = serving.rebalancer
    if not rebalancer.config.enabled:
        raise GatewayError(400, "expert load balancing is off: start with --enable-eplb")
    body = await serving.read_body(request)
    placement = None
    if body.strip():
        try:
            placement = json.loads(body)["placement"]
            if not isinstance(placement, dict) or not isinstance(placement.get("layers"),
                                                                 dict):
                raise TypeError("not a placement (num_ranks and layers)")
        except (ValueError, KeyError, TypeError) as exc:
            raise GatewayError(400, f"the body must be {{\"placement\": PLACEMENT}}: {exc}",
                               param="placement") from None
    try:
        record = await rebalancer.rebalance(placement)
    except ValueError as exc:
        raise GatewayError(400, str(exc)) from None
    return json_response({"rebalance": dataclasses.asdict(record) if record else None})


async def stats(serving: Serving, _: Request) -> Response:
    """GET /stats: the engine's counters (running/waiting, KV blocks, per-expert load)."""
    return json_response(await serving.engine.stats())


def build_app(config: GatewayConfig, engine_client: EnginePool,
              tokenizer: Tokenizer | None) -> Starlette:
    """The ASGI app; its lifespan keeps the engine connection up while it serves."""
    serving = Serving(config, engine_client, tokenizer)
    recorder = Recorder(serving, config.dashboard_interval_s, DASHBOARD_HISTORY_S)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine_client.run)
            tg.start_soon(recorder.run)
            if config.eplb.enabled:  # (its window, also for rebalances asked for)
                tg.start_soon(serving.rebalancer.run)
            yield
            tg.cancel_scope.cancel()
        tracing.shutdown()  # uvicorn re-raises SIGTERM after serving: atexit would not run

    routes = [
        Route("/v1/chat/completions", partial(create_chat_completion, serving), methods=["POST"]),
        Route("/v1/completions", partial(create_completion, serving), methods=["POST"]),
        Route("/v1/models", partial(list_models, serving), methods=["GET"]),
        Route("/health", partial(health, serving), methods=["GET"]),
        Route("/stats", partial(stats, serving), methods=["GET"]),
        Route("/eplb", partial(eplb, serving), methods=["GET"]),
        Route("/eplb/rebalance", partial(eplb_rebalance, serving), methods=["POST"]),
        Route("/tokenize", partial(tokenize, serving), methods=["POST"]),
        Route("/detokenize", partial(detokenize, serving), methods=["POST"]),
        Route("/version", show_version, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/metrics", partial(metrics, serving), methods=["GET"]),
        *dashboard_routes(recorder),
    ]
    handlers = {
        GatewayError: handle_gateway_error,
        HTTPException: handle_http_exception,
        Exception: handle_unexpected,
    }
    cors = config.cors
    middleware = [  # CORS first: a browser's preflight carries no key
        Middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                   allow_methods=list(cors.allowed_methods),
                   allow_headers=list(cors.allowed_headers)),
        Middleware(KeyAuth, access=config.access),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers,
                     middleware=middleware)
