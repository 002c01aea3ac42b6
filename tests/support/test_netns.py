"""`tests.support.netns`: nodes reach each other by name, a cut link is silent (no data,
no reset) and restoring it resumes the same connection, and nothing is left behind."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from tests.support.netns import (
    ETC_NETNS,
    Nodes,
    cleanup_stale,
    echo_server,
    netns_missing,
    read_line,
)

pytestmark = pytest.mark.skipif(netns_missing() is not None, reason=netns_missing() or "")

PORT = 7000
ECHO = echo_server(PORT)
# A client driven by lines on stdin: `echo WORD` (a round trip, 5 s at most), `send WORD`
# (no wait), `recv SECONDS`: what one blocked recv saw (data, eof, an error, or silence).
CLIENT = f"""
import socket, sys
c = socket.create_connection((sys.argv[1], {PORT}), timeout=5)
print("connected", c.getpeername()[0], flush=True)
for line in sys.stdin:
    cmd, arg = line.split()
    if cmd == "echo":
        c.settimeout(5)
        c.sendall(arg.encode())
        got = b""
        while len(got) < len(arg):
            got += c.recv(65536) or b"<eof>"
        print("echoed", got.decode(), flush=True)
    elif cmd == "send":
        c.sendall(arg.encode())
        print("sent", flush=True)
    elif cmd == "recv":
        c.settimeout(float(arg))
        try:
            data = c.recv(65536)
            print("data", data.decode() if data else "<eof>", flush=True)
        except TimeoutError:
            print("silent", flush=True)
        except OSError as exc:
            print("error", repr(exc), flush=True)
"""


def _ask(proc: subprocess.Popen[bytes], command: str, timeout: float) -> str:
    assert proc.stdin is not None
    proc.stdin.write(f"{command}\n".encode())
    proc.stdin.flush()
    return read_line(proc, timeout)


def _client(nodes: Nodes, node: str, server: str) -> subprocess.Popen[bytes]:
    return nodes.popen(node, [sys.executable, "-c", CLIENT, server], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, bufsize=0)


def _gone(tag: str) -> list[str]:
    """What is left of a `Nodes` with this tag: namespaces and /etc/netns directories."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            check=True, timeout=30).stdout
    left = [line.split()[0] for line in listed.splitlines() if line.startswith(tag)]
    if ETC_NETNS.is_dir():
        left += [str(p) for p in ETC_NETNS.iterdir() if p.name.startswith(tag)]
    return left


def test_nodes_talk_by_name_and_a_cut_link_is_silent_until_restored() -> None:
    with Nodes(["a", "b", "c"]) as nodes:
        nodes.add_alias("b", "sy-expert-0.sy-expert")
        server = nodes.popen("b", [sys.executable, "-c", ECHO], stdout=subprocess.PIPE,
                             bufsize=0)
        assert read_line(server, 10) == "listening"
        a = _client(nodes, "a", "b")
        c = _client(nodes, "c", "sy-expert-0.sy-expert")  # a Kubernetes-style alias
        assert read_line(a, 10) == f"connected {nodes.address('b')}" == "connected 10.77.0.3"
        assert read_line(c, 10) == f"connected {nodes.address('b')}"
        assert _ask(a, "echo ping", 10) == "echoed ping"

        nodes.cut("a")
        assert _ask(a, "send lost", 5) == "sent"  # into the void, retransmitted
        start = time.monotonic()
        assert _ask(a, "recv 2", 10) == "silent"  # no echo, no reset, no error: nothing
        assert time.monotonic() - start >= 2
        assert _ask(c, "echo other", 10) == "echoed other"  # only a's link is cut
        assert server.poll() is None

        nodes.restore("a")
        assert _ask(a, "recv 10", 15) == "data lost"  # the same connection carries on
        assert _ask(a, "echo pong", 10) == "echoed pong"
        tag, procs = nodes.tag, [server, a, c]
        assert _gone(tag)
    assert _gone(tag) == []
    assert all(p.poll() is not None for p in procs)


def test_leaving_by_an_exception_removes_everything() -> None:
    with pytest.raises(RuntimeError), Nodes(["a"]) as nodes:
        sleeper = nodes.popen("a", ["sleep", "300"])
        tag = nodes.tag
        raise RuntimeError("a test failed")
    assert _gone(tag) == []
    assert sleeper.wait(5) is not None


def _stale() -> str:
    """A namespace and /etc/netns directory as a run that was killed leaves them."""
    dead = subprocess.Popen(["true"])
    dead.wait(10)
    stale = f"sy-{dead.pid}.dead-a"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=30)
    (ETC_NETNS / stale).mkdir(parents=True)
    (ETC_NETNS / stale / "hosts").write_text("127.0.0.1 localhost\n")
    return stale


def test_cleanup_stale_removes_what_a_dead_run_left() -> None:
    made = []
    try:
        with Nodes(["a"]) as nodes:
            made.append(stale := _stale())
            removed = cleanup_stale()
            assert stale in removed
            assert not any(r.startswith(nodes.tag) for r in removed)  # a live run's: kept
            assert _gone(nodes.tag)
            assert _gone(stale) == []
            made.append(stale := _stale())
            with Nodes(["b"]):  # each one starting cleans up too
                assert _gone(stale) == []
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
