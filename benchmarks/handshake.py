""".venv/bin/python -m benchmarks.handshake --connections 2000

What the cluster secret's handshake costs a connection (`common.auth`).

Two listeners in one server process on loopback answer an `InfoRequest` per connection:
one runs the handshake first (as every service does), the other hands the stream straight
to the frames (as before it). The client times, per connection, connect + handshake +
one `InfoRequest` round trip + close, alternating between the two so that both see the same
machine. The handshake runs once per connection, never per message, so a step's exchanges
are unchanged by it.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import socket
import statistics
import time

import anyio
from anyio.abc import SocketAttribute, SocketStream

from common.auth import ClusterSecret
from common.messages import ExpertInfo, InfoRequest
from common.rpc import FrameStream, SocketFrames, accept, serve_messages

log = logging.getLogger("handshake")
INFO = ExpertInfo(rank=0, num_ranks=1, experts={}, weight_bytes=0)


async def _serve(secret: ClusterSecret, ports: mp.Queue) -> None:
    async def answer(conn: FrameStream) -> None:
        async def on_message(_: object) -> None:
            await conn.send(INFO)

        await serve_messages(conn, on_message, log)

    async def with_handshake(stream: SocketStream) -> None:
        if (conn := await accept(stream, secret, "client", log)) is not None:
            await answer(conn)

    async def without(stream: SocketStream) -> None:
        await answer(FrameStream(stream))

    a = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    b = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    ports.put((a.extra(SocketAttribute.local_port), b.extra(SocketAttribute.local_port)))
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.serve, with_handshake)
        tg.start_soon(b.serve, without)


def _server(key: bytes, ports: mp.Queue) -> None:
    anyio.run(_serve, ClusterSecret(key), ports)


def one(port: int, secret: ClusterSecret | None) -> float:
    """Seconds for a connection, its handshake (if `secret`) and one round trip."""
    start = time.perf_counter()
    deadline = time.monotonic() + 10
    if secret is None:
        conn = SocketFrames(socket.create_connection(("127.0.0.1", port), 10))
    else:
        conn = SocketFrames.connect("127.0.0.1", port, deadline, False, secret)
    conn.send(InfoRequest(), deadline)
    assert isinstance(conn.receive(deadline), ExpertInfo)
    conn.close()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=2000)
    args = ap.parse_args()
    secret = ClusterSecret.generate()
    ports: mp.Queue = mp.Queue()
    server = mp.Process(target=_server, args=(secret.key, ports), daemon=True)
    server.start()
    try:
        keyed, plain = ports.get(timeout=30)
        for _ in range(50):  # warm both paths
            one(keyed, secret), one(plain, None)
        times: dict[str, list[float]] = {"with the handshake": [], "without": []}
        for i in range(args.connections):
            times["with the handshake"].append(one(keyed, secret))
            times["without"].append(one(plain, None))
            if (i + 1) % (args.connections // 4) == 0:
                print(f"  {i + 1}/{args.connections} connections each", flush=True)
    finally:
        server.kill()
    base = statistics.median(times["without"])
    print("| connection set-up + one InfoRequest | median ms | p90 ms | p99 ms | "
          "median / without |")
    print("|---|---:|---:|---:|---:|")
    for name, t in times.items():
        q = statistics.quantiles(t, n=100)
        print(f"| {name} | {1e3 * statistics.median(t):.3f} | {1e3 * q[89]:.3f} | "
              f"{1e3 * q[98]:.3f} | {statistics.median(t) / base:.2f}x |")


if __name__ == "__main__":
    main()
