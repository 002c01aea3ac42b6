"""A TCP proxy that adds wire latency, for tests between network-namespace nodes.

This kernel has no `tc netem`, so a link between `tests.support.netns` nodes is as fast as
loopback; the ping-pong/overlap issue needs round trips that cost something. Put one of
these between two nodes by starting it on a node and pointing a service's address at it:

    nodes.popen("a", [sys.executable, "-m", "tests.support.delay_proxy",
                      "--listen", f"{nodes.address('a')}:7001",
                      "--to", f"{nodes.address('b')}:7000", "--delay-ms", "50"],
                stdout=subprocess.PIPE, bufsize=0, cwd=REPO_ROOT)
    # read_line(proc, 10) == "listening 10.77.0.2:7001"; clients on a use port 7001

In-process (its own event loop in a thread), for loopback tests:

    with DelayProxy(to=("127.0.0.1", port), delay_s=0.05) as proxy:
        socket.create_connection(proxy.address)

How the delay is applied: each accepted connection gets one connection to the target and
two directions. In each, a reader stamps every chunk it reads with a due time (read time
+ delay, + jitter) and queues it; a writer sends each chunk once its due time has come.
Reading goes on while earlier chunks wait, so the delay is a pipeline: a chunk is late by
the delay, not by the delay times the chunks before it, and throughput holds. A round
trip through the proxy costs at least twice the delay. EOF (a half-close) is passed on
at its due time like data; a reset read from one side is passed on as a reset (RST) at
its due time, and a failed write resets both sides at once.

Limits: no bandwidth limit and no loss; jitter never reorders (each due time is at least
the one before, as TCP delivers in order); at most `max_buffered` bytes (16 MiB) wait in
each direction, beyond which the reader waits, so a sender sees backpressure only then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

CHUNK = 64 * 1024  # the most one read takes
MAX_BUFFERED = 16 * 1024 * 1024


class _Eof:
    """Queued after the last chunk: the source half-closed."""


class _Reset:
    """Queued after the last chunk: the source reset or failed."""


Item = bytes | _Eof | _Reset
EOF, RESET = _Eof(), _Reset()


@dataclass
class Delay:
    """When a chunk read now is due: after `delay_s` plus uniform jitter in ±`jitter_s`
    (the sum never below zero), and never before the previous chunk of its direction."""

    delay_s: float
    jitter_s: float = 0.0
    rng: random.Random = field(default_factory=random.Random)
    _last: float = 0.0

    def due(self, now: float) -> float:
        extra = self.delay_s + self.rng.uniform(-self.jitter_s, self.jitter_s)
        self._last = max(self._last, now + max(0.0, extra))
        return self._last


class _Budget:
    """The bytes a direction holds; a reader waits while they are over the limit."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0
        self._changed = asyncio.Condition()

    async def take(self, n: int) -> None:
        async with self._changed:
            # held == 0: a chunk larger than the limit still goes, alone
            await self._changed.wait_for(lambda: self.held == 0 or self.held + n <= self.limit)
            self.held += n

    async def give(self, n: int) -> None:
        async with self._changed:
            self.held -= n
            self._changed.notify_all()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST rather than a FIN, so the peer sees what the other side did."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _read(reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, Item]],
                delay: Delay, budget: _Budget) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            data = await reader.read(CHUNK)
        except OSError:
            await queue.put((delay.due(loop.time()), RESET))
            return
        due = delay.due(loop.time())  # before waiting for room: that wait is part of the delay
        if not data:
            await queue.put((due, EOF))
            return
        await budget.take(len(data))
        await queue.put((due, data))


async def _write(writer: asyncio.StreamWriter, queue: asyncio.Queue[tuple[float, Item]],
                 budget: _Budget) -> None:
    loop = asyncio.get_running_loop()
    while True:
        due, item = await queue.get()
        while (left := due - loop.time()) > 0:  # loop: a timer may fire a hair early
            await asyncio.sleep(left)
        if isinstance(item, _Reset):
            raise ConnectionResetError("the other side reset")
        if isinstance(item, _Eof):
            if writer.can_write_eof():
                writer.write_eof()
            return
        writer.write(item)
        await writer.drain()
        await budget.give(len(item))


async def _direction(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     delay: Delay, max_buffered: int) -> None:
    queue: asyncio.Queue[tuple[float, Item]] = asyncio.Queue()
    budget = _Budget(max_buffered)
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(_read(reader, queue, delay, budget))
        tasks.create_task(_write(writer, queue, budget))


@dataclass
class _Config:
    to: tuple[str, int]
    delay_s: float
    jitter_s: float = 0.0
    max_buffered: int = MAX_BUFFERED


async def _relay(config: _Config, client_reader: asyncio.StreamReader,
                 client_writer: asyncio.StreamWriter) -> None:
    try:
        up_reader, up_writer = await asyncio.open_connection(*config.to)
    except OSError:
        _reset(client_writer)  # as the target would have: refused
        return
    delays = [Delay(config.delay_s, config.jitter_s) for _ in range(2)]
    try:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(_direction(client_reader, up_writer, delays[0],
                                         config.max_buffered))
            tasks.create_task(_direction(up_reader, client_writer, delays[1],
                                         config.max_buffered))
    except* OSError:
        for writer in (client_writer, up_writer):
            _reset(writer)
    finally:
        for writer in (client_writer, up_writer):
            writer.close()  # after an abort: a no-op; on cancellation: no leaked sockets


class _Server:
    """The listening socket and its connections' tasks (cancelled on close)."""

    def __init__(self, config: _Config) -> None:
        self.config = config
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._accept, host, port)
        return self._server.sockets[0].getsockname()[:2]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            # Cancelled by close(), at the top of its own task: ending quietly spares the
            # traceback that 3.11's start_server callback logs for a cancelled task.
            with contextlib.suppress(asyncio.CancelledError):
                await _relay(self.config, reader, writer)
        finally:
            self._tasks.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class DelayProxy:
    """The proxy on its own event loop in a daemon thread, while in the context.

    `address` is what it listens on (the port bound, where `listen` asked for 0)."""

    def __init__(self, to: tuple[str, int], delay_s: float = 0.05, *, jitter_s: float = 0.0,
                 listen: tuple[str, int] = ("127.0.0.1", 0),
                 max_buffered: int = MAX_BUFFERED) -> None:
        self.listen = listen
        self._config = _Config(to, delay_s, jitter_s, max_buffered)
        self._address: tuple[str, int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise RuntimeError("the proxy is not running")
        return self._address

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("the delay proxy did not start within 30 s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # handed to the caller of __enter__
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server = _Server(self._config)
        self._address = await server.start(*self.listen)
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await server.close()


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: not HOST:PORT")
    return host.strip("[]"), int(port)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.support.delay_proxy",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=_host_port, required=True, metavar="HOST:PORT")
    parser.add_argument("--to", type=_host_port, required=True, metavar="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay")
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="uniform, ± this")
    parser.add_argument("--ready-fd", type=int, default=None, metavar="FD",
                        help="write the 'listening HOST:PORT' line to FD (then close it) "
                             "rather than stdout")
    return parser.parse_args(argv)


def _announce(address: tuple[str, int], fd: int | None) -> None:
    line = f"listening {address[0]}:{address[1]}\n"
    if fd is None:
        sys.stdout.write(line)
        sys.stdout.flush()
        return
    os.write(fd, line.encode())
    os.close(fd)


async def _main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)  # a clean exit (0) on terminate()
    server = _Server(_Config(args.to, args.delay_ms / 1000, args.jitter_ms / 1000))
    _announce(await server.start(*args.listen), args.ready_fd)
    try:
        await stop.wait()
    finally:
        await server.close()


def main(argv: Sequence[str] | None = None) -> int:
    asyncio.run(_main(_parse(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
