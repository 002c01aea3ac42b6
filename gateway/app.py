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
from gateway.api.chat import create_chat_completion
from gateway.api.completions import create_completion
from gateway.api.openapi import openapi_json
from gateway.api.protocol import ModelCard, ModelList
from gateway.api.serving import Serving, json_response
from gateway.api.tokenization import detokenize, tokenize
from gateway.api.version import show_version
from gateway.config import GatewayConfig
from gateway.errors import (
    GatewayError,
    engine_unavailable,
    handle_gateway_error,
    handle_http_exception,
    handle_unexpected,
)
from gateway.observability.dashboard.page import dashboard_routes
from gateway.observability.dashboard.recorder import Recorder, Settings, Sources
from gateway.observability.metrics import Metrics
from gateway.observability.request_log import RequestLog
from gateway.observability.service_metrics import ServiceMetrics
from gateway.routing.engine_pool import EnginePool
from gateway.routing.rebalancer import Rebalancer
from gateway.text.tokenizer import Tokenizer

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
    """GET /health: whether the gateway can serve.

    It answers 200 once every attention group is connected, its warm-up generation has gone
    through every expert rank, and each group still answers. The body lists each backing
    service. Otherwise it answers 503 with the reason, such as a failed warm-up's error.
    """
    if not serving.engine.all_connected:
        return engine_unavailable("not connected to every attention service").response()
    if problem := serving.engine.warmup_problem():
        return engine_unavailable(problem).response()
    try:  # check that the groups are alive, not only connected
        groups = await serving.engine.group_stats(timeout=HEALTH_TIMEOUT_S)
    except GatewayError as exc:
        return exc.response()
    if not all(s.experts_ready for s in groups):
        return engine_unavailable("an expert service is unreachable").response()
    return json_response({"status": "ok", "attention": serving.engine.status(groups)})


async def metrics(sources: Sources, _: Request) -> Response:
    """GET /metrics, in Prometheus text format.

    The engine gauges are read now, and skipped if the engine is down. The services' series,
    such as per-expert and dispatch metrics, are scraped now and merged in.
    """
    try:
        stats = await sources.engine.stats() if sources.engine.all_connected else None
    except GatewayError:
        stats = None
    scrapes = await sources.services.scrape()
    body = await anyio.to_thread.run_sync(sources.metrics.render, stats, scrapes)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


async def eplb(rebalancer: Rebalancer, _: Request) -> Response:
    """GET /eplb: the expert load balancing settings and the recent rebalances.

    It also shows the placement the last rebalance moved to, which is None before the
    first rebalance.
    """
    return json_response({"enabled": rebalancer.config.enabled,
                          "interval_steps": rebalancer.config.interval,
                          "window_steps": rebalancer.config.window,
                          "num_redundant_experts": rebalancer.config.num_redundant,
                          "placement": rebalancer.placement,
                          "rebalances": [dataclasses.asdict(r) for r in rebalancer.history]})


async def eplb_rebalance(serving: Serving, rebalancer: Rebalancer, request: Request
                         ) -> Response:
    """POST /eplb/rebalance: move the experts now.

    The experts move to EPLB's placement for the window's load, or to the placement in the
    body, `{"placement": {...}}`, which holds a placement file's JSON. The answer is the
    rebalance's record, sent once every group routes by the new placement. If the record
    holds an `error`, the old placement still routes; for example, the new one may not fit
    the model. If the placement is already the one in use, the answer is
    `{"rebalance": null}`.
    """
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
    """GET /stats: the engine's counters: running and waiting requests, KV blocks, and
    per-expert load."""
    return json_response(await serving.engine.stats())


def build_app(config: GatewayConfig, engine_client: EnginePool,
              tokenizer: Tokenizer | None) -> Starlette:
    """Build the ASGI app. Its lifespan keeps the engine connection up while it serves."""
    model = config.served_model_name
    counters = Metrics(model)
    sources = Sources(engine_client, counters, ServiceMetrics(config.service_metrics),
                      Rebalancer(engine_client, config.eplb, counters.rebalanced), RequestLog())
    serving = Serving(config, engine_client, tokenizer, sources.metrics, sources.requests)
    recorder = Recorder(Settings(model, f"http://{config.host}:{config.port}",
                                 config.dashboard_interval_s, config.dashboard_window_s,
                                 config.otlp_ui_url), sources)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine_client.run)
            tg.start_soon(recorder.run)
            # The rebalancer keeps the load window, which rebalances on request need too.
            if config.eplb.enabled:
                tg.start_soon(sources.rebalancer.run)
            yield
            tg.cancel_scope.cancel()
        # uvicorn re-raises SIGTERM after serving, so atexit handlers would not run.
        tracing.shutdown()

    routes = [
        Route("/v1/chat/completions", partial(create_chat_completion, serving), methods=["POST"]),
        Route("/v1/completions", partial(create_completion, serving), methods=["POST"]),
        Route("/v1/models", partial(list_models, serving), methods=["GET"]),
        Route("/health", partial(health, serving), methods=["GET"]),
        Route("/stats", partial(stats, serving), methods=["GET"]),
        Route("/eplb", partial(eplb, sources.rebalancer), methods=["GET"]),
        Route("/eplb/rebalance", partial(eplb_rebalance, serving, sources.rebalancer),
              methods=["POST"]),
        Route("/tokenize", partial(tokenize, serving), methods=["POST"]),
        Route("/detokenize", partial(detokenize, serving), methods=["POST"]),
        Route("/version", show_version, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/metrics", partial(metrics, sources), methods=["GET"]),
        *dashboard_routes(recorder),
    ]
    handlers = {
        GatewayError: handle_gateway_error,
        HTTPException: handle_http_exception,
        Exception: handle_unexpected,
    }
    cors = config.cors
    middleware = [  # CORS comes first because a browser's preflight carries no key
        Middleware(CORSMiddleware, allow_origins=list(cors.allowed_origins),
                   allow_methods=list(cors.allowed_methods),
                   allow_headers=list(cors.allowed_headers)),
        Middleware(KeyAuth, access=config.access),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers,
                     middleware=middleware)
