"""`--link-timeout` (`common.rpc.set_liveness`): a peer whose link goes silent (cut, so
no reset ever comes) is dead within the timeout, on both ends of a service connection.

Two network namespaces (`tests.support.netns`): "expert" serves the way the services do
(`common.rpc.accept`), "attention" connects as the expert pool does (`SocketFrames`,
blocking) or as the gateway does (`common.rpc.connect`, async); then the expert's link is
cut. An idle connection's blocked reader, and a sender with data in flight, each see an
error within the timeout (and 2 s of slack); without liveness (0), nothing comes at all.
The measured times are printed (`pytest -s`)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.netns import Nodes, netns_missing, read_line

pytestmark = pytest.mark.skipif(netns_missing() is not None, reason=netns_missing() or "")

REPO = Path(__file__).resolve().parents[2]
LINK_TIMEOUT = 4.0  # the default
SLACK = 2.0
PORT = 7100

# Serves `accept`ed connections: an InfoRequest is sent back, anything else dropped;
# the error that ends a connection is printed with when it came.
SERVER = f"""
import logging, sys, time
import anyio
from common.auth import NO_SECRET
from common.messages import InfoRequest
from common.rpc import accept, peer_of

async def main():
    listener = await anyio.create_tcp_listener(local_host="0.0.0.0", local_port={PORT})
    print("listening", flush=True)

    async def on_connect(stream):
        conn = await accept(stream, NO_SECRET, peer_of(stream), logging.getLogger(),
                            float(sys.argv[1]))
        try:
            while True:
                if isinstance(msg := await conn.receive(), InfoRequest):
                    await conn.send(msg)
        except Exception as exc:
            print("error", time.monotonic(), repr(exc.__cause__ or exc), flush=True)

    await listener.serve(on_connect)

anyio.run(main)
"""
# Connects (argv: host, link timeout, blocking|async, idle|send), makes one round trip,
# says so, then reads (idle) or sends 64 KiB frames (send) until an error, printed with
# when it came.
CLIENT = f"""
import sys, time
import anyio
from common.messages import AbortRequest, InfoRequest
from common.rpc import SocketFrames, connect

host, link_timeout, path, action = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
big = AbortRequest("x" * 65536)

def said(exc):
    print("error", time.monotonic(), repr(exc.__cause__ or exc), flush=True)

def blocking():
    conn = SocketFrames.connect(host, {PORT}, time.monotonic() + 10, link_timeout=link_timeout)
    conn.send(InfoRequest(), time.monotonic() + 5)
    assert isinstance(conn.receive(time.monotonic() + 5), InfoRequest)
    print("connected", flush=True)
    try:
        while True:
            if action == "idle":
                conn.receive(time.monotonic() + 300)
            else:
                conn.send(big, time.monotonic() + 300)
    except Exception as exc:
        said(exc)

async def asynchronous():
    conn = await connect(host, {PORT}, timeout=10, link_timeout=link_timeout)
    await conn.send(InfoRequest())
    assert isinstance(await conn.receive(), InfoRequest)
    print("connected", flush=True)
    try:
        with anyio.fail_after(300):
            while True:
                if action == "idle":
                    await conn.receive()
                else:
                    await conn.send(big)
    except Exception as exc:
        said(exc)

blocking() if path == "blocking" else anyio.run(asynchronous)
"""


def _error_after(proc: subprocess.Popen[bytes], since: float, timeout: float) -> float:
    """Seconds from `since` to the error `proc` prints (its clock is this one's:
    CLOCK_MONOTONIC is the machine's, in every network namespace)."""
    word, when, what = read_line(proc, timeout).split(" ", 2)
    assert word == "error", what
    print(f"    {what}")
    return float(when) - since


def _connected_pair(nodes: Nodes, link_timeout: float, path: str, action: str
                    ) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    pipes = dict(stdout=subprocess.PIPE, bufsize=0, cwd=REPO)
    server = nodes.popen("expert", [sys.executable, "-c", SERVER, str(link_timeout)],
                         **pipes)
    assert read_line(server, 30) == "listening"
    client = nodes.popen("attention", [sys.executable, "-c", CLIENT, "expert",
                                       str(link_timeout), path, action], **pipes)
    assert read_line(client, 30) == "connected"
    return server, client


@pytest.mark.parametrize("action", ["idle", "send"])
@pytest.mark.parametrize("path", ["blocking", "async"])
def test_a_silent_link_is_a_dead_peer_within_the_link_timeout(path: str, action: str) -> None:
    with Nodes(["attention", "expert"]) as nodes:
        server, client = _connected_pair(nodes, LINK_TIMEOUT, path, action)
        cut = time.monotonic()
        nodes.cut("expert")
        client_s = _error_after(client, cut, LINK_TIMEOUT + SLACK)
        server_s = _error_after(server, cut, LINK_TIMEOUT + SLACK)
        print(f"link timeout {LINK_TIMEOUT:g}s, {path} client, {action}: client saw the "
              f"cut after {client_s:.2f}s, the accepting side after {server_s:.2f}s")
        assert 0 < client_s <= LINK_TIMEOUT + SLACK
        assert 0 < server_s <= LINK_TIMEOUT + SLACK


def test_without_liveness_a_cut_link_goes_unnoticed() -> None:
    """The control: with --link-timeout 0 (the kernel's defaults) neither end learns of
    the cut in the time the liveness needs."""
    with Nodes(["attention", "expert"]) as nodes:
        server, client = _connected_pair(nodes, 0, "blocking", "idle")
        nodes.cut("expert")
        for proc in (client, server):
            with pytest.raises(TimeoutError):
                read_line(proc, LINK_TIMEOUT + SLACK if proc is client else 0.1)
