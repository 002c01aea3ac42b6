"""Ports and URLs of local services."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def http_url(host: str, port: int) -> str:
    """The URL of a service bound to `host`: IPv6 in brackets, and a wildcard address
    reached on loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def free_port() -> int:
    """A port free now, for a process that binds it a moment later. It is drawn from below
    the kernel's ephemeral range, which every bind to port 0 draws from: the services that
    start meanwhile (they listen on port 0) cannot take it first. Another caller of this
    function in another process could, a smaller race (random draws among thousands of
    ports); in this one, no port is handed out twice."""
    low = _ephemeral_low()
    start = max(1024, low - 16384)
    for _ in range(200 if low - start >= 256 else 0):  # (a range from 1024 leaves no room)
        port = random.randrange(start, low)
        if port in _HANDED_OUT:  # not bound yet by whoever got it
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use, or in TIME_WAIT
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as sock:  # nothing free down there: any port, with the old race
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_HANDED_OUT: set[int] = set()  # this process's free_port() results


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for port 0: Linux's ip_local_port_range, else
    the IANA dynamic range's 49152 (macOS, Windows)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152
