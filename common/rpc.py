"""Service RPC: `common.messages.Message` frames over anyio TCP streams.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
"""

from __future__ import annotations

import logging
import signal
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable

import anyio
import msgspec
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream

from common.messages import Message

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 256 * 1024 * 1024

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def _frame_length(header: bytes | bytearray) -> int:
    """A frame's length from its header; a ValueError past the limit."""
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    return length


class FrameStream:
    """One connection carrying `Message` frames in both directions.

    Sends are serialised by a lock so that concurrent tasks never interleave frames.
    """

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self._send_lock = anyio.Lock()
        self.closed = False  # set by aclose: work it sent and that waits is abandoned

    async def send(self, message: Message) -> None:
        payload = _encoder.encode(message)
        async with self._send_lock:
            await self._stream.send(_HEADER.pack(len(payload)) + payload)

    async def receive(self) -> Message:
        """The next message; raises `anyio.EndOfStream` when the peer closed, also in the
        middle of a frame."""
        try:
            length = _frame_length(await self._reader.receive_exactly(_HEADER.size))
            body = await self._reader.receive_exactly(length)
        except anyio.IncompleteRead as exc:
            raise anyio.EndOfStream from exc
        return _decoder.decode(body)

    async def aclose(self) -> None:
        self.closed = True
        await self._stream.aclose()


class SocketFrames:
    """`FrameStream`'s frames over a blocking socket, used by one thread at a time: the
    engine's step thread makes a layer's exchange on these itself, so the exchange
    crosses no thread and no event loop. Every call is bounded by a deadline
    (`time.monotonic()`); a timeout raises `TimeoutError`, a peer that closed `EOFError`."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    @classmethod
    def connect(cls, host: str, port: int, deadline: float, retry: bool = True
                ) -> SocketFrames:
        """Connect by `deadline`, retrying (if `retry`) until the peer listens; without
        retrying, a refused connection raises its OSError at once."""
        delay = 0.05
        while True:
            try:
                return cls(socket.create_connection((host, port), _left(deadline)))
            except OSError:
                if not retry or time.monotonic() + delay >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def send(self, message: Message, deadline: float) -> int:
        """Send one frame; returns its payload's bytes."""
        payload = _encoder.encode(message)
        self.sock.settimeout(_left(deadline))
        self.sock.sendall(_HEADER.pack(len(payload)) + payload)
        return len(payload)

    def receive(self, deadline: float) -> Message:
        length = _frame_length(self._exactly(_HEADER.size, deadline))
        return _decoder.decode(self._exactly(length, deadline))

    def _exactly(self, n: int, deadline: float) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            self.sock.settimeout(_left(deadline))
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise EOFError("the peer closed the connection")
            got += k
        return buf

    def close(self) -> None:
        self.sock.close()


def _left(deadline: float) -> float:
    """Seconds to `deadline`; past it, a timeout (a socket timeout of 0 would not block)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


async def serve_messages(conn: FrameStream, handle: Callable[[Message], Awaitable[None]],
                         log: logging.Logger) -> None:
    """Give each message from `conn` to `handle` until the peer goes away; a frame that
    cannot be decoded drops the connection, never the service. Closes `conn`."""
    try:
        while True:
            await handle(await conn.receive())
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
    except Exception:
        log.exception("dropping a connection that sent a bad frame")
    finally:
        await conn.aclose()


def run_service(name: str, host: str, port: int, serve: Callable[..., Awaitable[None]],
                *args: object) -> int:
    """`anyio.run(serve, *args)` for a service process: 0 when it ends, 2 with a one-line
    error when its listener cannot bind (a connection's errors stay in its own task)."""
    try:
        anyio.run(serve, *args)
    except OSError as exc:
        print(f"switchyard {name}: cannot listen on {host}:{port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    return 0


async def cancel_on_signal(scope: anyio.CancelScope) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


async def connect(host: str, port: int, timeout: float = 30.0, retry: bool = True
                  ) -> FrameStream:
    """Connect to a service, retrying (if `retry`) until it listens or `timeout` seconds
    pass; without retrying, a refused connection raises its OSError at once."""
    delay = 0.05
    with anyio.fail_after(timeout):
        while True:
            try:
                return FrameStream(await anyio.connect_tcp(host, port))
            except OSError:
                if not retry:
                    raise
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port), with a clear error for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected an address of the form HOST:PORT, got {address!r}")
    return host, int(port)
