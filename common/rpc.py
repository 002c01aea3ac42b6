"""Service RPC: `common.messages.Message` frames over anyio TCP streams.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
"""

from __future__ import annotations

import logging
import signal
import struct
import sys
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
            (length,) = _HEADER.unpack(await self._reader.receive_exactly(_HEADER.size))
            if length > MAX_FRAME_BYTES:
                raise ValueError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES} "
                                 "byte limit")
            body = await self._reader.receive_exactly(length)
        except anyio.IncompleteRead as exc:
            raise anyio.EndOfStream from exc
        return _decoder.decode(body)

    async def aclose(self) -> None:
        self.closed = True
        await self._stream.aclose()


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
