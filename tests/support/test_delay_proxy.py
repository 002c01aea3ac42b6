"""`tests.support.delay_proxy`: a round trip costs twice the delay, chunks in flight are
pipelined (not delayed one after another), bytes arrive intact and in order, EOF and
resets pass through, the CLI starts and stops cleanly, and it works between netns nodes."""

from __future__ import annotations

import hashlib
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.delay_proxy import DelayProxy
from tests.support.netns import Nodes, echo_server, netns_missing, read_line

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]  # where `python -m tests.support...` resolves
SLACK = 0.05  # what a loaded 2-core machine adds to a round trip, at most in the median


@dataclass
class Echo:
    """A threaded echo server on loopback; what its connections ended with."""

    address: tuple[str, int]
    ends: list[str] = field(default_factory=list)  # "eof" or "reset", one a connection
    ended: threading.Event = field(default_factory=threading.Event)

    def serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
                self.ends.append("eof")
            except ConnectionResetError:
                self.ends.append("reset")
            self.ended.set()


@pytest.fixture
def echo() -> Iterator[Echo]:
    listener = socket.create_server(("127.0.0.1", 0))
    server = Echo(listener.getsockname())

    def accept() -> None:
        while True:
            try:
                conn = listener.accept()[0]
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=server.serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    with listener:
        yield server
        listener.shutdown(socket.SHUT_RDWR)  # wakes accept()


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"EOF after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def _round_trips(address: tuple[str, int], count: int) -> list[float]:
    with _connect(address) as sock:
        times = []
        for i in range(count):
            payload = f"ping {i:04d}".encode()
            start = time.monotonic()
            sock.sendall(payload)
            assert _recv_exactly(sock, len(payload)) == payload
            times.append(time.monotonic() - start)
        return times


def test_round_trip_costs_twice_the_delay(echo: Echo) -> None:
    delay = 0.05
    direct = _round_trips(echo.address, 20)
    with DelayProxy(to=echo.address, delay_s=delay) as proxy:
        delayed = _round_trips(proxy.address, 20)
    print(f"direct median {statistics.median(direct) * 1e3:.2f} ms; through the proxy "
          f"(D={delay * 1e3:g} ms) min {min(delayed) * 1e3:.2f} ms, median "
          f"{statistics.median(delayed) * 1e3:.2f} ms, max {max(delayed) * 1e3:.2f} ms")
    assert statistics.median(direct) < delay / 5
    assert min(delayed) >= 2 * delay
    assert statistics.median(delayed) < 2 * delay + SLACK


def test_jitter_stays_within_its_bounds(echo: Echo) -> None:
    delay, jitter = 0.05, 0.02
    with DelayProxy(to=echo.address, delay_s=delay, jitter_s=jitter) as proxy:
        times = _round_trips(proxy.address, 20)  # and each echo in order (_round_trips)
    assert min(times) >= 2 * (delay - jitter)
    assert max(times) < 2 * (delay + jitter) + 0.25
    assert max(times) - min(times) > 0.005  # it does vary


def test_chunks_in_flight_are_pipelined(echo: Echo) -> None:
    """50 records sent 5 ms apart, with 200 ms (2 x 100 ms) to go round: each comes back
    200 ms after it left. Delaying chunk by chunk would make the last some 5 s late."""
    delay, count, gap, size = 0.1, 50, 0.005, 64
    sent: list[float] = []
    with DelayProxy(to=echo.address, delay_s=delay) as proxy, _connect(proxy.address) as sock:

        def send() -> None:
            for i in range(count):
                sent.append(time.monotonic())
                sock.sendall(struct.pack("!I", i).ljust(size, b"."))
                time.sleep(gap)  # pacing, so the proxy reads the records one by one

        sender = threading.Thread(target=send)
        sender.start()
        back = []
        for i in range(count):
            assert struct.unpack("!I", _recv_exactly(sock, size)[:4])[0] == i
            back.append(time.monotonic())
        sender.join(10)
    latencies = [b - s for b, s in zip(back, sent, strict=True)]
    print(f"pipelined: latency min {min(latencies) * 1e3:.1f} ms, max "
          f"{max(latencies) * 1e3:.1f} ms; all back {(back[-1] - sent[0]) * 1e3:.0f} ms "
          f"after the first left")
    assert min(latencies) >= 2 * delay
    assert max(latencies) < 2 * delay + 0.3
    assert back[-1] - sent[0] < count * gap + 2 * delay + 0.5


def test_large_transfer_intact_and_in_order(echo: Echo) -> None:
    payload = os.urandom(8 * 1024 * 1024)
    with DelayProxy(to=echo.address, delay_s=0.01) as proxy, _connect(proxy.address) as sock:

        def send() -> None:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send)
        sender.start()
        digest, received = hashlib.sha256(), 0
        while chunk := sock.recv(1 << 20):
            digest.update(chunk)
            received += len(chunk)
        sender.join(10)
    assert received == len(payload)
    assert digest.digest() == hashlib.sha256(payload).digest()


def test_eof_passes_through_after_the_delay(echo: Echo) -> None:
    delay = 0.05
    with DelayProxy(to=echo.address, delay_s=delay) as proxy, _connect(proxy.address) as sock:
        start = time.monotonic()
        sock.shutdown(socket.SHUT_WR)
        assert echo.ended.wait(10)
        server_saw = time.monotonic() - start
        assert sock.recv(1) == b""  # the echo server closed: EOF, back through the proxy
        client_saw = time.monotonic() - start
    assert echo.ends == ["eof"]
    assert server_saw >= delay
    assert client_saw >= 2 * delay


def test_reset_passes_through(echo: Echo) -> None:
    with DelayProxy(to=echo.address, delay_s=0.02) as proxy:
        sock = _connect(proxy.address)
        sock.sendall(b"x")
        assert _recv_exactly(sock, 1) == b"x"
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # an RST
        assert echo.ended.wait(10)
    assert echo.ends == ["reset"]


def _cli(target: tuple[str, int], *extra: str, **kwargs: Any) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tests.support.delay_proxy", "--listen", "127.0.0.1:0",
            "--to", f"{target[0]}:{target[1]}", "--delay-ms", "50", *extra]
    return subprocess.Popen(argv, cwd=ROOT, **kwargs)


def _address(line: str) -> tuple[str, int]:
    word, _, address = line.partition(" ")
    assert word == "listening", line
    host, _, port = address.rpartition(":")
    return host, int(port)


def test_cli_listens_relays_and_exits_cleanly(echo: Echo) -> None:
    proc = _cli(echo.address, stdout=subprocess.PIPE, bufsize=0)
    try:
        address = _address(read_line(proc, 30))
        assert address[0] == "127.0.0.1" and address[1] > 0
        assert _round_trips(address, 1)[0] >= 0.1
        proc.terminate()
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def test_cli_ready_fd(echo: Echo) -> None:
    read_end, write_end = os.pipe()
    proc = _cli(echo.address, "--ready-fd", str(write_end), pass_fds=[write_end])
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as ready:
            line = ready.readline()  # the proxy closes its end after the line: no hang
        assert _round_trips(_address(line.decode().strip()), 1)[0] >= 0.1
        proc.terminate()
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait(10)


PORT, PROXY_PORT = 7000, 7001
ECHO = echo_server(PORT)
# Round trips to (argv[1], argv[2]): prints the min and median, in seconds.
CLIENT = """
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for i in range(10):
    start = time.monotonic()
    c.sendall(b"ping")
    got = b""
    while len(got) < 4:
        got += c.recv(4) or sys.exit("eof")
    times.append(time.monotonic() - start)
print(min(times), statistics.median(times), flush=True)
"""


@pytest.mark.skipif(netns_missing() is not None, reason=netns_missing() or "")
def test_between_netns_nodes() -> None:
    delay = 0.05
    with Nodes(["a", "b"]) as nodes:
        a, b = nodes.address("a"), nodes.address("b")
        server = nodes.popen("b", [sys.executable, "-c", ECHO], stdout=subprocess.PIPE,
                             bufsize=0)
        assert read_line(server, 30) == "listening"
        proxy = nodes.popen("a", [sys.executable, "-m", "tests.support.delay_proxy",
                                  "--listen", f"{a}:{PROXY_PORT}", "--to", f"{b}:{PORT}",
                                  "--delay-ms", str(delay * 1000)],
                            stdout=subprocess.PIPE, bufsize=0, cwd=ROOT)
        assert read_line(proxy, 30) == f"listening {a}:{PROXY_PORT}"

        def client(host: str, port: int) -> tuple[float, float]:
            done = nodes.run("a", [sys.executable, "-c", CLIENT, host, str(port)],
                             timeout=30, capture_output=True, text=True, check=True)
            low, median = map(float, done.stdout.split())
            return low, median

        direct, delayed = client(b, PORT), client(a, PROXY_PORT)
    print(f"netns: direct a->b median {direct[1] * 1e3:.2f} ms; a->proxy(a)->b "
          f"min {delayed[0] * 1e3:.2f} ms, median {delayed[1] * 1e3:.2f} ms")
    assert direct[1] < delay / 5
    assert delayed[0] >= 2 * delay
    assert delayed[1] < 2 * delay + SLACK
