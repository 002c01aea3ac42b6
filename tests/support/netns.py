"""Hosts for multi-host tests without a cluster: each node a Linux network namespace.

`Nodes(["a", "b"])` makes one namespace per node and a hub namespace holding a bridge
that joins them: node i's `eth0` (one end of a veth pair; the other end, a port of the
hub's bridge) has the subnet's (i+2)th address, .2, .3, ... of 10.77.0.0/24. Nothing is
made in the host's own namespace. `/etc/netns/<namespace>/hosts` names every node (and
each alias, `add_alias`), and `ip netns exec` binds it over `/etc/hosts`: a process that
`popen` starts on a node reaches the others by name.

`cut(node)` silences a node's link, the way a partition beyond its NIC does: its bridge
port is disabled (`bridge link set dev PORT state disabled`), so every frame to and from
it is dropped at the bridge. Both ends' interfaces stay up, with carrier: nothing on
either side learns of the cut, and since no packet crosses, no RST and no ICMP error comes
back; a blocked read waits, data sent is retransmitted into the void. `restore(node)`
turns the port back to forwarding, and retransmissions carry on where they were
(`tests/support/test_netns.py` checks all of it).

Everything needs root (and the `ip` and `bridge` commands): `netns_missing()` says why
not, for `pytest.mark.skipif`. Leaving the context, also by an exception or Ctrl-C, kills
every process started on the nodes (process group and all) and removes every namespace
(with it, its veths and bridge) and `/etc/netns` directory made; namespace names carry
their maker's pid, so `cleanup_stale()` (also run by each `Nodes` as it starts)
removes what a run that died (SIGKILL) left behind.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import os
import secrets
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

PREFIX = "sy-"  # every namespace made here: sy-<pid>.<random>-<node>, and -hub
ETC_NETNS = Path("/etc/netns")
_HUB = "hub"
_BRIDGE = "br0"  # in the hub's namespace, so no name can clash with another's


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True,
                          timeout=30)


def _namespaces() -> list[str]:
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _remove_namespace(ns: str) -> None:
    """Kill whatever still runs in `ns`, then remove it and its /etc/netns directory."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "delete", ns, check=False)
    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)


@functools.cache
def netns_missing() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "bridge"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (iproute2)"
    probe = f"{PREFIX}{os.getpid()}.probe"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "delete", probe, check=False)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    return None


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Remove the namespaces (and /etc/netns directories) named `prefix<pid>.…` whose
    making process is gone; the names removed."""
    removed = []
    names = set(_namespaces())
    if ETC_NETNS.is_dir():
        names |= {p.name for p in ETC_NETNS.iterdir()}
    for ns in sorted(names):
        pid = ns[len(prefix):].partition(".")[0]
        if not ns.startswith(prefix) or not pid.isdigit() or _alive(int(pid)):
            continue
        _remove_namespace(ns)
        removed.append(ns)
    return removed


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The next line `proc` writes to its stdout (a pipe, `bufsize=0`), without its
    newline; TimeoutError if none comes within `timeout`, EOFError if stdout closes."""
    assert proc.stdout is not None
    fd, line, deadline = proc.stdout.fileno(), bytearray(), time.monotonic() + timeout
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"no line from {proc.args!r} within {timeout:g}s "
                               f"(so far: {bytes(line)!r})")
        byte = os.read(fd, 1)  # one at a time: nothing read past the line
        if not byte:
            raise EOFError(f"{proc.args!r} closed its output (exit {proc.poll()})")
        line += byte
    return line[:-1].decode()


def echo_server(port: int) -> str:
    """Python code (`python -c`) for an echo server on every address at `port`: it says
    "listening" once it does, and every connection (a thread each) gets back what it
    sends."""
    return f"""
import socket, threading
def echo(c):
    while data := c.recv(65536):
        c.sendall(data)
s = socket.create_server(("0.0.0.0", {port}))
print("listening", flush=True)
while True:
    threading.Thread(target=echo, args=(s.accept()[0],), daemon=True).start()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Nodes:
    """Namespaced hosts on one bridge; a context manager (see the module's docstring)."""

    def __init__(self, names: Sequence[str], subnet: str = "10.77.0.0/24",
                 prefix: str = PREFIX) -> None:
        net = ipaddress.ip_network(subnet)
        hosts = list(net.hosts())
        if len(set(names)) != len(names) or len(names) + 1 > len(hosts) or _HUB in names:
            raise ValueError(f"nodes {list(names)}: not distinct names other than "
                             f"{_HUB!r} that fit {subnet}")
        self.names = list(names)
        self.prefix_len, self.prefix = net.prefixlen, prefix
        self.tag = f"{prefix}{os.getpid()}.{secrets.token_hex(2)}"
        self._addresses = {n: str(hosts[i + 1]) for i, n in enumerate(names)}  # .2 on
        self._aliases: dict[str, list[str]] = {n: [] for n in names}
        self._made: list[str] = []  # namespaces, in the order made
        self._procs: list[subprocess.Popen[Any]] = []

    def namespace(self, node: str) -> str:
        self._check(node)
        return f"{self.tag}-{node}"

    def address(self, node: str) -> str:
        self._check(node)
        return self._addresses[node]

    def _check(self, node: str) -> None:
        if node not in self._addresses:
            raise KeyError(f"no node {node!r} (nodes: {', '.join(self.names)})")

    @property
    def _hub(self) -> str:
        return f"{self.tag}-{_HUB}"

    def __enter__(self) -> Nodes:
        cleanup_stale(self.prefix)  # what dead runs left
        atexit.register(self.close)
        try:
            self._add_namespace(self._hub)
            _ip("-n", self._hub, "link", "add", _BRIDGE, "type", "bridge")
            _ip("-n", self._hub, "link", "set", _BRIDGE, "up")
            for i, node in enumerate(self.names):
                ns = self.namespace(node)
                self._add_namespace(ns)
                _ip("-n", self._hub, "link", "add", f"v{i}", "type", "veth", "peer", "name",
                    "eth0", "netns", ns)
                _ip("-n", self._hub, "link", "set", f"v{i}", "master", _BRIDGE, "up")
                _ip("-n", ns, "addr", "add", f"{self._addresses[node]}/{self.prefix_len}",
                    "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
            self._write_hosts()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _write_hosts(self) -> None:
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        lines += [" ".join([self._addresses[n], n, *self._aliases[n]]) for n in self.names]
        for node in self.names:
            etc = ETC_NETNS / self.namespace(node)
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")

    def add_alias(self, node: str, name: str) -> None:
        """Make `name` (e.g. a Kubernetes-style `sy-expert-0.sy-expert`) resolve to
        `node`'s address on every node (for processes started from now on)."""
        self._check(node)
        self._aliases[node].append(name)
        self._write_hosts()

    def _exec(self, node: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(node), *argv]

    def popen(self, node: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """`argv` started on `node`, in a session (process group) of its own: leaving
        the context kills the group."""
        proc = subprocess.Popen(self._exec(node, argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, node: str, argv: Sequence[str], timeout: float = 60,
            **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """`argv` run to its end on `node` (`subprocess.run`'s keywords), within `timeout`."""
        return subprocess.run(self._exec(node, argv), timeout=timeout, **kwargs)

    def _port(self, node: str) -> str:
        return f"v{self.names.index(node)}"

    def cut(self, node: str) -> None:
        """Silence `node`'s link: every frame to or from it dropped at the bridge."""
        self._check(node)
        subprocess.run(["bridge", "-n", self._hub, "link", "set", "dev", self._port(node),
                        "state", "0"], check=True, capture_output=True, timeout=30)

    def restore(self, node: str) -> None:
        """Undo `cut`: the node's bridge port forwards again."""
        self._check(node)
        subprocess.run(["bridge", "-n", self._hub, "link", "set", "dev", self._port(node),
                        "state", "3"], check=True, capture_output=True, timeout=30)

    def close(self) -> None:
        """Kill every process started, remove everything made (idempotent)."""
        atexit.unregister(self.close)
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        self._procs.clear()
        for ns in reversed(self._made):
            _remove_namespace(ns)
        self._made.clear()
