"""Service RPC: `common.messages.Message` frames over anyio TCP streams.

A connection first runs `common.auth`'s handshake, in which both sides prove the cluster
secret. Then each frame is a 4-byte big-endian length followed by that many bytes of
msgpack.

`accept` closes a peer that fails the handshake before a byte of its frames is read. So
decoding, and everything after it, only ever sees authenticated peers. A frame's length is
checked against `MAX_FRAME_BYTES` before its body is read. A frame that does not decode
drops that one connection. The handlers check every field that indexes memory.

Every internal connection has TCP keep-alives and `TCP_USER_TIMEOUT`, set from
`--link-timeout` by `set_liveness`. A cut link sends no reset, so these make it fail the
connection within that time. Then the crash failover runs: replicas, a held step, and the
gateway's resubmission. The `rpc` dispatch backend sends its frames over blocking sockets
on the step thread, with `SocketFrames`.
"""

from __future__ import annotations

import logging
import math
import signal
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable

import anyio
import msgspec
from anyio.abc import ByteStream, SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream

from common import auth
from common.auth import NO_SECRET, ClusterSecret, HandshakeError
from common.messages import Message

_HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 256 * 1024 * 1024
# The default `--link-timeout`: a link silent this long means a dead peer. Measured, a cut
# link was found 0.1-0.5 s after this, within the 5 s aimed at. See "A cut link" in
# docs/benchmarks.md.
LINK_TIMEOUT_S = 4.0

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def _frame_length(header: bytes | bytearray) -> int:
    """A frame's length from its header. Raises ValueError past the limit."""
    (length,) = _HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES} byte limit")
    return length


def set_liveness(sock: socket.socket, timeout_s: float) -> None:
    """Declare the peer dead once the link is silent for about `timeout_s`.

    The socket's calls then fail with ETIMEDOUT. A host whose link is cut is silent like
    this, because it sends no reset. On an idle link, keep-alive probes find the silence.
    They are sent every timeout/5 s, at least every second, after a silence that long.
    With data sent and not acknowledged, TCP_USER_TIMEOUT finds it. It also fires when
    the peer acknowledges nothing, or keeps its window shut because it stopped reading,
    for `timeout_s`. A `timeout_s` of 0 or less keeps the kernel's defaults: hours when
    idle, and some 15 minutes with data in flight.
    """
    if timeout_s <= 0:
        return
    interval = max(1, round(timeout_s / 5))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT,
                    max(1, math.ceil(timeout_s / interval) - 1))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, math.ceil(timeout_s * 1000))


def _stream_liveness(stream: ByteStream, timeout_s: float) -> None:
    """`set_liveness` on a TCP stream's socket. Other kinds of stream have no socket."""
    sock = stream.extra(SocketAttribute.raw_socket, None)
    if sock is not None:
        set_liveness(sock, timeout_s)


class FrameStream:
    """One connection carrying `Message` frames in both directions.

    Sends are serialised by a lock so that concurrent tasks never interleave frames.
    """

    def __init__(self, stream: ByteStream,
                 reader: BufferedByteReceiveStream | None = None) -> None:
        self._stream = stream
        self._reader = reader or BufferedByteReceiveStream(stream)
        self._send_lock = anyio.Lock()
        self.closed = False  # set by aclose; work sent on it that still waits is abandoned

    async def send(self, message: Message) -> None:
        payload = _encoder.encode(message)
        async with self._send_lock:
            await self._stream.send(_HEADER.pack(len(payload)) + payload)

    async def receive(self) -> Message:
        """The next message.

        Raises `anyio.EndOfStream` when the peer closed, also in the middle of a frame.
        """
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
    """`FrameStream`'s frames over a blocking socket, used by one thread at a time.

    The engine's step thread makes a layer's exchange on these itself, so the exchange
    crosses no thread and no event loop. Every call is bounded by a deadline in
    `time.monotonic()` time. A timeout raises `TimeoutError`, and a peer that closed raises
    `EOFError`.
    """

    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    @classmethod
    def connect(cls, host: str, port: int, deadline: float, retry: bool = True,
                secret: ClusterSecret = NO_SECRET,
                link_timeout: float = LINK_TIMEOUT_S) -> SocketFrames:
        """Connect by `deadline` and prove `secret`.

        With `retry`, this retries until the peer listens. Without it, a refused connection
        raises its OSError at once. A connection reset during the handshake is retried
        too: a service killed just as it accepted us resets it, and its successor may be
        listening soon. A peer that fails the handshake raises `HandshakeError`, an
        OSError, at once. A link silent for `link_timeout` fails the connection; see
        `set_liveness`.
        """
        delay = 0.05
        while True:
            try:
                sock = socket.create_connection((host, port), _left(deadline))
                try:
                    set_liveness(sock, link_timeout)
                    client_handshake(sock, secret, deadline)
                except BaseException:
                    sock.close()
                    raise
            except HandshakeError:
                raise
            except OSError:
                if not retry or time.monotonic() + delay >= deadline:
                    raise
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            return cls(sock)

    def send(self, message: Message, deadline: float) -> int:
        """Send one frame; returns its payload's bytes."""
        payload = _encoder.encode(message)
        self.sock.settimeout(_left(deadline))
        self.sock.sendall(_HEADER.pack(len(payload)) + payload)
        return len(payload)

    def receive(self, deadline: float) -> Message:
        length = _frame_length(_recv_exactly(self.sock, _HEADER.size, deadline))
        return _decoder.decode(_recv_exactly(self.sock, length, deadline))

    def close(self) -> None:
        self.sock.close()


_CLOSED_IN_HANDSHAKE = ("the service closed the connection during the handshake (is it "
                        "restarting, or does it hold another cluster secret?)")


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        sock.settimeout(_left(deadline))
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("the peer closed the connection")
        got += k
    return buf


def client_handshake(sock: socket.socket, secret: ClusterSecret, deadline: float) -> None:
    """The client's side of `common.auth`'s exchange, on a blocking socket, by `deadline`."""
    try:
        response, expected = auth.respond(
            secret, bytes(_recv_exactly(sock, auth.CHALLENGE_BYTES, deadline)))
        sock.settimeout(_left(deadline))
        sock.sendall(response)
        auth.check_proof(bytes(_recv_exactly(sock, auth.MAC_BYTES, deadline)), expected)
    except EOFError as exc:
        raise HandshakeError(_CLOSED_IN_HANDSHAKE) from exc


def _left(deadline: float) -> float:
    """Seconds to `deadline`. Past it, raise TimeoutError.

    A socket timeout of 0 would not block, so it must not be returned.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def peer_of(stream: ByteStream) -> str:
    """A connection's remote HOST:PORT, for logs."""
    try:
        host, port = stream.extra(SocketAttribute.remote_address)[:2]
    except (TypeError, ValueError, anyio.TypedAttributeLookupError):
        return "an unknown peer"
    return f"{host}:{port}"


_refused: set[str] = set()  # hosts whose failed handshake was logged, once each


async def accept(stream: ByteStream, secret: ClusterSecret, peer: str,
                 log: logging.Logger, link_timeout: float = LINK_TIMEOUT_S
                 ) -> FrameStream | None:
    """A listener's new connection, once the peer has proved `secret`.

    Otherwise returns None, closes the stream, and logs the peer's address once per host.
    No frame is read before the proof. A link silent for `link_timeout` fails the
    connection; see `set_liveness`.
    """
    _stream_liveness(stream, link_timeout)
    reader = BufferedByteReceiveStream(stream)
    challenge, nonce = auth.challenge()
    try:
        with anyio.fail_after(auth.HANDSHAKE_TIMEOUT_S):
            await stream.send(challenge)
            response = await reader.receive_exactly(auth.RESPONSE_BYTES)
            await stream.send(auth.verify(secret, nonce, response))
        return FrameStream(stream, reader)
    except (HandshakeError, TimeoutError, anyio.IncompleteRead, anyio.EndOfStream,
            anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
        host = peer.rpartition(":")[0]
        if host not in _refused:  # once per address, so a scan cannot flood the log
            _refused.add(host)
            log.warning("refused a connection from %s: %s (later ones from %s are not "
                        "logged)", peer, exc if isinstance(exc, HandshakeError)
                        else "no handshake", host)
        await stream.aclose()
        return None


async def serve_messages(conn: FrameStream, handle: Callable[[Message], Awaitable[None]],
                         log: logging.Logger) -> None:
    """Give each message from `conn` to `handle` until the peer goes away.

    A frame that cannot be decoded drops the connection, never the service. Closes `conn`.
    """
    try:
        while True:
            await handle(await conn.receive())
    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
    except (msgspec.DecodeError, ValueError) as exc:  # hostile or broken; log one line
        log.warning("dropping a connection that sent a bad frame: %s", exc)
    except Exception:
        log.exception("dropping a connection whose message could not be handled")
    finally:
        await conn.aclose()


def run_service(name: str, host: str, port: int, serve: Callable[..., Awaitable[None]],
                *args: object) -> int:
    """`anyio.run(serve, *args)` for a service process.

    Returns 0 when it ends. Returns 2, with a one-line error, when its listener cannot
    bind. A connection's errors stay in that connection's own task.
    """
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


async def connect(host: str, port: int, timeout: float = 30.0, retry: bool = True,
                  secret: ClusterSecret = NO_SECRET,
                  link_timeout: float = LINK_TIMEOUT_S) -> FrameStream:
    """Connect to a service and prove `secret`.

    With `retry`, this retries until the service listens or `timeout` seconds pass.
    Without it, a refused connection raises its OSError at once. A connection reset during
    the handshake counts as refused; that happens when a service stops as we connect. A
    service that fails the handshake raises `HandshakeError` at once. A link silent for
    `link_timeout` fails the connection; see `set_liveness`.
    """
    delay = 0.05
    with anyio.fail_after(timeout):
        while True:
            try:
                stream = await anyio.connect_tcp(host, port)
                try:
                    _stream_liveness(stream, link_timeout)
                    return await _client_handshake(stream, secret)
                except BaseException:
                    await stream.aclose()
                    raise
            except HandshakeError:
                raise
            except (OSError, anyio.BrokenResourceError) as exc:
                if not retry:
                    raise ConnectionResetError(f"{host}:{port}: {exc!r}") from exc
                await anyio.sleep(delay)
                delay = min(delay * 2, 1.0)


async def _client_handshake(stream: ByteStream, secret: ClusterSecret) -> FrameStream:
    reader = BufferedByteReceiveStream(stream)
    try:
        with anyio.fail_after(auth.HANDSHAKE_TIMEOUT_S):
            response, expected = auth.respond(
                secret, await reader.receive_exactly(auth.CHALLENGE_BYTES))
            await stream.send(response)
            auth.check_proof(await reader.receive_exactly(auth.MAC_BYTES), expected)
    except (anyio.IncompleteRead, anyio.EndOfStream) as exc:
        raise HandshakeError(_CLOSED_IN_HANDSHAKE) from exc
    return FrameStream(stream, reader)


def parse_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port), with a clear error for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected an address of the form HOST:PORT, got {address!r}")
    return host, int(port)
