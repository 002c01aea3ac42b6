"""`common.rpc`'s blocking client connection against a listener that resets its first
connections, as a service killed just after accepting them does."""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import pytest
from anyio.abc import SocketAttribute, SocketStream
from anyio.from_thread import start_blocking_portal

from common.auth import NO_SECRET
from common.rpc import SocketFrames, accept
from tests.support.tools import wait_until

log = logging.getLogger(__name__)


@contextmanager
def resetting_listener(resets: int) -> Iterator[tuple[int, list[str]]]:
    """A loopback listener that resets its first `resets` connections at once (SO_LINGER
    0), then completes the handshake of the others; yields its port and what it did."""
    seen: list[str] = []

    async def handle(stream: SocketStream) -> None:
        if len(seen) < resets:
            seen.append("reset")
            stream.extra(SocketAttribute.raw_socket).setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await stream.aclose()
            return
        conn = await accept(stream, NO_SECRET, "test", log)
        seen.append("accepted" if conn is not None else "refused")
        await anyio.sleep(5)  # (held open while the client checks it)

    async def serve(started: anyio.Event, port: list[int]) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        port.append(listener.extra(SocketAttribute.local_port))
        started.set()
        await listener.serve(handle)

    with start_blocking_portal() as portal:
        port: list[int] = []
        started = portal.call(anyio.Event)
        future = portal.start_task_soon(serve, started, port)
        portal.call(started.wait)
        try:
            yield port[0], seen
        finally:
            future.cancel()


def test_a_connection_reset_in_the_handshake_is_retried_until_the_deadline() -> None:
    with resetting_listener(resets=2) as (port, seen):
        conn = SocketFrames.connect("127.0.0.1", port, time.monotonic() + 10, retry=True)
        # (the listener records its side of the handshake after the client's returns)
        wait_until(lambda: len(seen) == 3, 10, lambda: f"the listener's record: {seen}")
        conn.close()
        assert seen == ["reset", "reset", "accepted"]


def test_without_retry_a_reset_is_raised_at_once() -> None:
    with resetting_listener(resets=1) as (port, _), \
            pytest.raises(ConnectionResetError):
        SocketFrames.connect("127.0.0.1", port, time.monotonic() + 10, retry=False)
