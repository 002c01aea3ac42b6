"""Server-sent events, and tying a response's lifetime to its engine request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayError

DONE = b"data: [DONE]\n\n"
T = TypeVar("T")

_encoder = msgspec.json.Encoder()


def event(payload: object) -> bytes:
    """One SSE `data:` event carrying `payload` as JSON."""
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def error_event(error: GatewayError) -> bytes:
    """How a failure after the response started reaches the client, as in vLLM."""
    return event(error.body())


class EventStreamResponse(StreamingResponse):
    """An SSE response that runs `on_close` however it ends: done, failed or disconnected."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]
                 ) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Starlette cancels the stream when the client disconnects. The abort must
            # still go out.
            with anyio.CancelScope(shield=True):
                await self._on_close()


async def until_disconnected(request: Request) -> None:
    """Return once the client has gone away. The body must already have been read."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run `work`, cancelling it and returning None if the client disconnects first.

    Servers do not cancel a handler whose client left, so long non-streamed requests watch
    for the disconnect themselves.
    """
    result: list[T] = []

    async def run_work(scope: anyio.CancelScope) -> None:
        result.append(await work())
        scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run_work, tg.cancel_scope)
            await until_disconnected(request)
            tg.cancel_scope.cancel()
    except* GatewayError as group:
        raise group.exceptions[0] from None
    return result[0] if result else None
