"""GET /openapi.json: an OpenAPI 3.1 description of the gateway, generated from the very
msgspec Structs the endpoints decode and encode, so it cannot drift from what they accept."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from common.messages import EngineStats
from gateway.api.protocol import (
    PROMPT_SCHEMA,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
)
from gateway.api.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from gateway.api.version import VersionResponse, package_version
from gateway.errors import ErrorBody

REF_TEMPLATE = "#/components/schemas/{name}"
_GENERATION_ERRORS = (400, 404, 413, 429, 503)
_TOKENIZATION_ERRORS = (400, 404, 413, 503)
_JSON = "application/json"


def ref(kind: type) -> dict[str, str]:
    """A reference to `kind`'s schema in the document's components."""
    return {"$ref": REF_TEMPLATE.format(name=kind.__name__)}


@dataclass(frozen=True)
class Operation:
    """One path and method: what it takes, what it answers, and how it can fail."""

    path: str
    method: str
    summary: str
    request: type | None = None  # the JSON body it decodes
    response: type | None = None  # None means a JSON object that no Struct describes
    stream_event: type | None = None  # with `stream: true`, it sends SSE events of this type
    errors: tuple[int, ...] = ()
    media_type: str = _JSON


OPERATIONS = (
    Operation("/v1/completions", "post", "Continue a prompt (text or token ids)",
              CompletionRequest, Completion, Completion, _GENERATION_ERRORS),
    Operation("/v1/chat/completions", "post", "Reply to a conversation",
              ChatCompletionRequest, ChatCompletion, ChatCompletionChunk, _GENERATION_ERRORS),
    Operation("/v1/models", "get", "The served model", response=ModelList),
    Operation("/tokenize", "post", "Token ids of a prompt or a conversation (vLLM)",
              TokenizeRequest, TokenizeResponse, errors=_TOKENIZATION_ERRORS),
    Operation("/detokenize", "post", "Text of token ids (vLLM)", DetokenizeRequest,
              DetokenizeResponse, errors=_TOKENIZATION_ERRORS),
    Operation("/health", "get", "200 once every attention group is connected and warmed up",
              errors=(503,)),
    Operation("/stats", "get", "Engine counters summed over the attention groups",
              response=EngineStats, errors=(503,)),
    Operation("/eplb", "get", "Expert load balancing: its settings, the placement the last "
              "rebalance moved to, and the last rebalances"),
    Operation("/eplb/rebalance", "post", "Move the experts now: to EPLB's placement of the "
              "recent routing load, or to the body's {\"placement\": PLACEMENT}; answers "
              "the rebalance's record once every attention group routes by it",
              errors=(400, 503)),
    Operation("/version", "get", "The Switchyard version", response=VersionResponse),
    Operation("/metrics", "get", "Prometheus metrics", media_type="text/plain"),
    Operation("/openapi.json", "get", "This document"),
)


def _responses(op: Operation) -> dict[str, Any]:
    if op.media_type != _JSON:
        ok: dict[str, Any] = {op.media_type: {"schema": {"type": "string"}}}
    else:
        ok = {_JSON: {"schema": ref(op.response) if op.response else {"type": "object"}}}
    if op.stream_event is not None:
        # An SSE body is text to OpenAPI 3.1. Name the event schema so clients can find it.
        ok["text/event-stream"] = {
            "schema": {"type": "string", "description":
                       f"`data: <{op.stream_event.__name__} JSON>` events, then `data: [DONE]`"},
            "x-event-schema": ref(op.stream_event),
        }
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    for status in op.errors:
        responses[str(status)] = {"description": "Error",
                                  "content": {_JSON: {"schema": ref(ErrorBody)}}}
    return responses


def _operation(op: Operation) -> dict[str, Any]:
    out: dict[str, Any] = {"summary": op.summary, "responses": _responses(op)}
    if op.request is not None:
        out["requestBody"] = {"required": True,
                              "content": {_JSON: {"schema": ref(op.request)}}}
    return out


def openapi_document() -> dict[str, Any]:
    """The whole document. It is built from the Structs, so new request fields appear by
    themselves."""
    kinds = {kind for op in OPERATIONS for kind in (op.request, op.response, op.stream_event)
             if kind is not None}
    kinds.add(ErrorBody)
    _, components = msgspec.json.schema_components(
        sorted(kinds, key=lambda k: k.__name__), ref_template=REF_TEMPLATE)
    components["CompletionRequest"]["properties"]["prompt"] = PROMPT_SCHEMA
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {"title": "Switchyard", "version": package_version(),
                 "description": "OpenAI-compatible API (with vLLM's extensions) of a "
                                "Mixture-of-Experts serving system."},
        "paths": paths,
        "components": {"schemas": components},
    }


@cache
def _encoded() -> bytes:
    # The Structs cannot change while the process runs, so encode the document once.
    return msgspec.json.encode(openapi_document())


async def openapi_json(_: Request) -> Response:
    """GET /openapi.json."""
    return Response(_encoded(), media_type=_JSON)
