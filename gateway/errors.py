"""OpenAI/vLLM-style error bodies, and the exception that carries them to the client."""

from __future__ import annotations

import logging
from http import HTTPStatus

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

log = logging.getLogger(__name__)


def _error_type(status: int) -> str:
    """OpenAI's error type: the status phrase in CamelCase ending in Error, e.g. NotFoundError."""
    name = HTTPStatus(status).phrase.replace(" ", "")
    return name if name.endswith("Error") else f"{name}Error"


class ErrorDetail(msgspec.Struct):
    """The `error` object of an OpenAI error body. Its `code` repeats the HTTP status."""

    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(msgspec.Struct):
    """`{"error": {...}}`, the shape the OpenAI clients parse."""

    error: ErrorDetail


class GatewayError(Exception):
    """A request failed in a way the client should hear about with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    def body(self) -> ErrorBody:
        """The JSON body describing this error."""
        detail = ErrorDetail(self.message, _error_type(self.status), self.param, self.status)
        return ErrorBody(detail)

    def response(self) -> Response:
        """A complete JSON error response."""
        body = msgspec.json.encode(self.body())
        return Response(body, self.status, headers=self.headers,
                        media_type="application/json")


def bad_request(message: str, param: str | None = None) -> GatewayError:
    """A 400 for input the client must change."""
    return GatewayError(400, message, param)


def engine_unavailable(reason: str) -> GatewayError:
    """A 503 for an engine that is not reachable, or no longer is. Retrying later may work."""
    return GatewayError(503, f"The engine is unavailable: {reason}")


async def handle_gateway_error(_: Request, exc: Exception) -> Response:
    """Starlette exception handler for `GatewayError`."""
    assert isinstance(exc, GatewayError)
    return exc.response()


async def handle_http_exception(_: Request, exc: Exception) -> Response:
    """Render Starlette's own errors (unknown route, wrong method) in the OpenAI shape."""
    assert isinstance(exc, HTTPException)
    return GatewayError(exc.status_code, exc.detail, headers=exc.headers).response()


async def handle_unexpected(_: Request, exc: Exception) -> Response:
    """A bug, not bad input: log it and answer 500 rather than dropping the connection."""
    log.exception("unhandled error in request", exc_info=exc)
    return GatewayError(500, "Internal server error").response()
