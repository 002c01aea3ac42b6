"""The gateway's one connection to the engine, shared by every request.

Requests are multiplexed by request id. `start` sends a `GenerateRequest`, and a reader
task routes each `TokenDelta` to that request's memory stream. When the connection drops,
every in-flight request fails with 503 and `run` reconnects in the background.

`keep_warm` warms up each connection with one generation that the engine routes through
every expert rank, like vLLM's start-up dummy run. `/health` answers 200 only once that
generation has come back. A warm-up that failed is retried, and meanwhile `/health`
reports its error.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
from typing import Any, TypeVar

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from common.auth import NO_SECRET, ClusterSecret, HandshakeError
from common.messages import (
    AbortRequest,
    EngineInfo,
    EngineStats,
    GenerateRequest,
    InfoRequest,
    Message,
    PlacementPlan,
    PlanPlacement,
    Rebalance,
    Rebalanced,
    SamplingParams,
    StatsRequest,
    TokenDelta,
)
from common.rpc import FrameStream, connect
from gateway.errors import GatewayError, engine_unavailable

log = logging.getLogger(__name__)
A = TypeVar("A")  # the type of an answer from the engine

# What a broken or misbehaving connection raises; any of them ends the connection.
_CONNECTION_ERRORS = (
    OSError, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
    msgspec.DecodeError, ValueError,
)


class Generation:
    """One in-flight request: iterate for its `TokenDelta`s, then `aclose` it."""

    def __init__(self, client: EngineClient, request_id: str,
                 deltas: MemoryObjectReceiveStream[tuple[TokenDelta, float]]) -> None:
        self.request_id = request_id
        self._client = client
        self._deltas = deltas
        self.finished = False
        self.lost = False  # its group's connection died before its last delta came
        self.arrived: float | None = None  # time.monotonic() when the last delta came in

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> TokenDelta:
        if self.finished:
            raise StopAsyncIteration
        try:
            delta, self.arrived = await self._deltas.receive()
        except anyio.EndOfStream:
            # The reader closes the stream without a final delta only when the connection
            # died.
            self.finished = self.lost = True
            raise engine_unavailable("lost the connection to the engine") from None
        self.finished = delta.finish_reason is not None
        return delta

    async def aclose(self) -> None:
        """Forget the request. If it is still running, tell the engine to abort it."""
        self._deltas.close()
        if self._client.release(self.request_id) and not self.finished:
            await self._client.abort(self.request_id)


class EngineClient:
    """Multiplexes generate requests over one TCP connection to the engine."""

    def __init__(self, host: str, port: int, retry_interval_s: float = 1.0,
                 secret: ClusterSecret = NO_SECRET, link_timeout_s: float = 5.0) -> None:
        self._host, self._port = host, port
        self._secret = secret
        self._link_timeout_s = link_timeout_s  # an engine silent this long is gone
        self._retry_interval_s = retry_interval_s
        self._frames: FrameStream | None = None
        self._info: EngineInfo | None = None
        self.last_info: EngineInfo | None = None  # kept across connections
        # Each request's deltas, each with the time it arrived. This way latencies are the
        # engine's, not how soon a client reads them.
        self._pending: dict[str, MemoryObjectSendStream[tuple[TokenDelta, float]]] = {}
        self._ready = anyio.Event()
        # Questions to the engine that await their answer, by the answer's type and key.
        # The key is a rebalance's version. A key of None means one question of that type
        # at a time, which `_asking` enforces.
        self._answers: dict[tuple[type, int | None], MemoryObjectSendStream[Any]] = {}
        self._asking: dict[type, anyio.Lock] = {}
        self._down = anyio.Event()  # set when the current connection is lost
        self._warmed = anyio.Event()  # set once the warm-up came back, once per connection
        self.warmup_error: str | None = None  # the last warm-up's error, until one works

    @property
    def address(self) -> str:
        return f"{self._host}:{self._port}"

    @property
    def warm(self) -> bool:
        """Whether this connection's warm-up generation came back."""
        return self._info is not None and self._warmed.is_set()

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    @property
    def info(self) -> EngineInfo | None:
        """The engine's self-description while connected, else None."""
        return self._info

    async def wait_ready(self) -> EngineInfo:
        """Wait until connected and described. Callers bound this with a timeout."""
        while self._info is None:
            await self._ready.wait()
        return self._info

    async def wait_warm(self) -> None:
        """Wait until a connection's warm-up has come back. Callers bound this wait."""
        while not self.warm:
            await self._warmed.wait()

    async def run(self) -> None:
        """Stay connected to the engine until cancelled, reconnecting after failures."""
        while True:
            try:
                frames = await connect(self._host, self._port, timeout=math.inf,
                                       secret=self._secret, link_timeout=self._link_timeout_s)
            # A misconfigured deployment is logged, then retried.
            except HandshakeError as exc:
                log.warning("attention service %s:%d: %s", self._host, self._port, exc)
                await anyio.sleep(self._retry_interval_s)
                continue
            # connect() retries by itself, but this loop must go on after what it raises.
            except _CONNECTION_ERRORS as exc:
                log.warning("attention service %s:%d: %r", self._host, self._port, exc)
                await anyio.sleep(self._retry_interval_s)
                continue
            try:
                await self._serve(frames)
            except _CONNECTION_ERRORS as exc:
                log.warning("engine connection lost (%r); reconnecting", exc)
            finally:
                self._fail_pending()
                with anyio.CancelScope(shield=True):
                    await frames.aclose()
            await anyio.sleep(self._retry_interval_s)

    async def _serve(self, frames: FrameStream) -> None:
        await frames.send(InfoRequest())
        info = await frames.receive()
        if not isinstance(info, EngineInfo):
            raise ValueError(f"expected EngineInfo, got {type(info).__name__}")
        self._down = anyio.Event()
        self._frames, self._info = frames, info
        self.last_info = info
        self._ready.set()
        log.info("connected to engine %s:%d (%s)", self._host, self._port, info.architecture)
        while True:
            self._route(await frames.receive())

    def _route(self, message: Message) -> None:
        if isinstance(message, EngineStats | PlacementPlan | Rebalanced):
            key = message.version if isinstance(message, Rebalanced) else None
            if (waiter := self._answers.pop((type(message), key), None)) is not None:
                waiter.send_nowait(message)
            return  # no waiter: an answer that came after its question's timeout
        if not isinstance(message, TokenDelta):
            log.warning("ignoring unexpected %s from the engine", type(message).__name__)
            return
        stream = self._pending.get(message.request_id)
        if stream is None:
            return  # a request we already released, e.g. aborted
        # An unbounded buffer, so one slow client never stalls the others.
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            stream.send_nowait((message, time.monotonic()))
        if message.finish_reason is not None:
            self.release(message.request_id)

    def _fail_pending(self) -> None:
        self._frames, self._info = None, None
        self._down.set()
        if self._warmed.is_set():  # replaced as `_ready` is, below
            self._warmed = anyio.Event()
        # Replace only a spent event, because waiters may be parked on this one.
        if self._ready.is_set():
            self._ready = anyio.Event()
        for stream in self._pending.values():
            stream.close()
        self._pending.clear()
        for waiter in self._answers.values():
            waiter.close()
        self._answers.clear()

    async def keep_warm(self, retry_s: float = 2.0) -> None:
        """Warm up each connection once it is made, until cancelled.

        A failed warm-up is tried again every `retry_s` until it works, since an expert rank
        may come back.
        """
        while True:
            await self.wait_ready()
            down = self._down
            error = await self._warm_up()
            if down.is_set():  # the connection went, so warm up the next one
                continue
            self.warmup_error = error
            if error is None:
                self._warmed.set()
                await down.wait()
                continue
            log.error("warm-up of attention service %s failed: %s", self.address, error)
            with anyio.move_on_after(retry_s):
                await down.wait()

    async def _warm_up(self) -> str | None:
        """Run one warm-up generation and return its error, if any.

        The engine makes the warm-up prompt.
        """
        request = GenerateRequest(f"warm-up-{uuid.uuid4().hex}", [],
                                  SamplingParams(max_tokens=1, temperature=0.0), warmup=True)
        try:
            generation = await self.start(request)
            try:
                async for delta in generation:
                    if delta.error is not None:
                        return delta.error
            finally:
                await generation.aclose()
        except GatewayError as exc:
            return exc.message
        return None

    async def start(self, request: GenerateRequest) -> Generation:
        """Send a request. Raise a 503 `GatewayError` if the engine is not connected."""
        frames = self._frames
        if frames is None:
            raise engine_unavailable("not connected to the engine")
        send, receive = anyio.create_memory_object_stream[tuple[TokenDelta, float]](math.inf)
        self._pending[request.request_id] = send
        try:
            # Shielded so a cancelled caller never leaves half a frame on the shared stream.
            with anyio.CancelScope(shield=True):
                await frames.send(request)
        except _CONNECTION_ERRORS as exc:
            self.release(request.request_id)
            raise engine_unavailable(f"sending to the engine failed ({exc!r})") from exc
        return Generation(self, request.request_id, receive)

    async def stats(self, timeout: float = 10.0) -> EngineStats:
        """Ask the engine for its counters."""
        return await self._ask(StatsRequest(), EngineStats, None, timeout,
                               "no stats from the engine")

    async def plan(self, request: PlanPlacement, timeout: float) -> PlacementPlan:
        """The group's EPLB placement of a load."""
        return await self._ask(request, PlacementPlan, None, timeout, "no placement plan")

    async def rebalance(self, request: Rebalance, timeout: float) -> Rebalanced:
        """Have the group move its experts to `request`'s placement, and return its answer.

        If the answer holds an `error`, the old placement still routes. The request is sent
        whole even if cancelled, because a half-sent frame would break the connection.
        """
        return await self._ask(request, Rebalanced, request.version, timeout,
                               "no answer to the rebalance", shield=True)

    async def _ask(self, question: Message, answer: type[A], key: int | None,
                   timeout: float, what: str, shield: bool = False) -> A:
        """Send `question` and wait for its `answer`.

        The answer is matched by type and `key`. With key None, only one such question is
        asked at a time. Raises a 503 `GatewayError` saying `what` if the group is not
        connected or does not answer within `timeout`.
        """
        async with self._asking.setdefault(answer, anyio.Lock()) if key is None \
                else contextlib.nullcontext():
            frames = self._frames
            if frames is None:
                raise engine_unavailable("not connected to the engine")
            send, receive = anyio.create_memory_object_stream[A](1)
            self._answers[(answer, key)] = send
            try:
                with anyio.fail_after(timeout), receive:
                    with anyio.CancelScope(shield=shield):
                        await frames.send(question)
                    return await receive.receive()
            except (TimeoutError, anyio.EndOfStream, *_CONNECTION_ERRORS) as exc:
                raise engine_unavailable(f"{what} ({exc!r})") from exc
            finally:
                self._answers.pop((answer, key), None)
                send.close()

    def release(self, request_id: str) -> bool:
        """Stop routing deltas for a request. Returns True if it was still registered."""
        stream = self._pending.pop(request_id, None)
        if stream is not None:
            stream.close()
        return stream is not None

    async def abort(self, request_id: str) -> None:
        """Ask the engine to abort a request, on a best-effort basis.

        If the connection is dead, the engine has already dropped the request.
        """
        frames = self._frames
        if frames is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                await frames.send(AbortRequest(request_id))
            except _CONNECTION_ERRORS:
                log.debug("could not send abort for %s", request_id)
