"""The `rpc` backend's expert side: a TCP listener that any number of attention ranks
connect to (M:N). Batches of one layer that arrive while the last computation runs are
answered together by the next: one grouped GEMM for M attention ranks' rows.

A rebalance's `PlacementUpdate` is loaded on a thread of its own, one at a time, while
layer calls go on. Each connection says which placement version it lays rows out by,
with `UsePlacement` and in every batch's version. The versions no connection uses any more
are released."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import msgspec
from anyio.abc import SocketAttribute, SocketStream

from common.auth import NO_SECRET, ClusterSecret
from common.compute import ComputeThread
from common.messages import (
    ExpertBatch,
    ExpertInfo,
    ExpertResult,
    InfoRequest,
    Message,
    PlacementReady,
    PlacementUpdate,
    UsePlacement,
)
from common.rpc import (
    LINK_TIMEOUT_S,
    FrameStream,
    accept,
    cancel_on_signal,
    peer_of,
    serve_messages,
)

log = logging.getLogger("switchyard.expert")


@dataclass(frozen=True)
class RpcListen:
    """Where an expert rank listens, and what answers there.

    answer: batches of one layer, from any attention ranks, -> one result each, in order.
        It runs on one worker thread (`common.compute`), one call at a time. It must answer
        every batch, a bad one with its error, and never raise.
    info: the handshake's answer (`InfoRequest` -> `ExpertInfo`).
    prepare: a rebalance's load (`PlacementUpdate` -> `PlacementReady`), blocking. It must
        answer, never raise.
    release: told the placement versions the connections use now, whenever that changes.
    secret: what a connection must prove before any of its frames is read (`common.auth`).
    link_timeout: a connection silent this long has lost its attention rank (`set_liveness`).
    """

    host: str
    port: int
    answer: Callable[[list[ExpertBatch]], list[ExpertResult]]
    info: Callable[[], ExpertInfo]
    prepare: Callable[[PlacementUpdate], PlacementReady]
    release: Callable[[set[int]], None]
    secret: ClusterSecret = NO_SECRET
    link_timeout: float = LINK_TIMEOUT_S


class Coalescer:
    """The queue between the connections and the computation."""

    def __init__(self, answer: Callable[[list[ExpertBatch]], list[ExpertResult]]) -> None:
        self._answer = answer
        self._compute = ComputeThread("expert-compute", "expert")  # every computation on one thread
        self._queue: list[tuple[ExpertBatch, FrameStream, float]] = []  # and arrival
        self._arrived = anyio.Event()
        self.num_coalesced = 0  # batches that shared a computation with an earlier one

    def submit(self, batch: ExpertBatch, conn: FrameStream) -> None:
        self._queue.append((batch, conn, time.perf_counter()))
        self._arrived.set()

    async def run(self) -> None:
        """Whatever arrived for the first queued batch's layer and placement version goes
        into one `answer`."""
        while True:
            if not self._queue:
                await self._arrived.wait()
                self._arrived = anyio.Event()
                continue
            first = self._queue[0][0]
            key = (first.layer, first.version)
            todo = [q for q in self._queue if (q[0].layer, q[0].version) == key]
            self._queue = [q for q in self._queue if (q[0].layer, q[0].version) != key]
            results = await self._compute.run(self._answer, [b for b, _, _ in todo])
            self.num_coalesced += len(todo) - 1
            for (_, conn, arrived), result in zip(todo, results, strict=True):
                held = msgspec.structs.replace(result, held_s=time.perf_counter() - arrived)
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await conn.send(held)


class Versions:
    """The placement version each connection lays its rows out by, told to `release`
    whenever the set of them changes."""

    def __init__(self, release: Callable[[set[int]], None]) -> None:
        self._release = release
        self._by_conn: dict[FrameStream, int] = {}

    def use(self, conn: FrameStream, version: int | None) -> None:
        """`conn` uses `version` now; None means it closed."""
        if self._by_conn.get(conn) == version:
            return
        before = set(self._by_conn.values())
        if version is None:
            del self._by_conn[conn]
        else:
            self._by_conn[conn] = version
        if (now := set(self._by_conn.values())) != before:
            self._release(now)


async def serve_rpc(listen: RpcListen, ready: Callable[[int], None]) -> None:
    """Serve until SIGTERM or SIGINT; `ready` gets the bound port once listening.

    Raises:
        OSError: the listener cannot bind ("cannot listen on HOST:PORT: ...").
    """
    try:
        listener = await anyio.create_tcp_listener(local_host=listen.host,
                                                   local_port=listen.port)
    except OSError as exc:
        raise OSError(f"cannot listen on {listen.host}:{listen.port}: "
                      f"{exc.strerror or exc}") from exc
    ready(listener.extra(SocketAttribute.local_port))
    queue = Coalescer(listen.answer)
    versions = Versions(listen.release)
    loading = anyio.CapacityLimiter(1)  # one placement loads at a time

    async def prepare(update: PlacementUpdate, conn: FrameStream) -> None:
        ready = await anyio.to_thread.run_sync(listen.prepare, update, limiter=loading)
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await conn.send(ready)

    async def on_connect(stream: SocketStream) -> None:
        conn = await accept(stream, listen.secret, peer_of(stream), log, listen.link_timeout)
        if conn is None:
            return

        async def on_message(msg: Message) -> None:
            if isinstance(msg, InfoRequest):
                await conn.send(listen.info())
            elif isinstance(msg, ExpertBatch):
                versions.use(conn, msg.version)
                queue.submit(msg, conn)
            elif isinstance(msg, UsePlacement):
                versions.use(conn, msg.version)
            elif isinstance(msg, PlacementUpdate):
                tg.start_soon(prepare, msg, conn)  # this connection's next message goes on
            else:
                log.warning("ignoring unexpected %s", type(msg).__name__)

        try:
            await serve_messages(conn, on_message, log)
        finally:
            versions.use(conn, None)

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_on_signal, tg.cancel_scope)
        tg.start_soon(queue.run)
        await listener.serve(on_connect)
