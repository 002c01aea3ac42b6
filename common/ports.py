"""Ports and URLs of local services."""

from __future__ import annotations

import fcntl
import json
import os
import random
import socket
import tempfile
import time
from pathlib import Path


def http_url(host: str, port: int, https: bool = False) -> str:
    """The URL of a service bound to `host`: IPv6 in brackets, and a wildcard address
    reached on loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    scheme = "https" if https else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def free_port() -> int:
    """A port free now, for a process that binds it a moment later; a service takes
    seconds to start, importing torch.

    It is drawn from below the kernel's ephemeral range, which every bind to port 0 draws
    from, so the services that start meanwhile, listening on port 0, cannot take it first.
    No port is handed out twice within `RESERVED_S`, by this process or another of this
    user's on this machine (`_reserve`).
    """
    low = _ephemeral_low()
    start = max(1024, low - 16384)
    for _ in range(200 if low - start >= 256 else 0):  # a range from 1024 leaves no room
        port = random.randrange(start, low)
        if port in _HANDED_OUT or not _reserve(port):  # not bound yet by whoever got it
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
RESERVED_S = 300.0  # how long another process's free_port() result is not handed out
RESERVATIONS = Path(tempfile.gettempdir()) / f"switchyard-ports-{os.getuid()}.json"


def _reserve(port: int) -> bool:
    """Note `port` in this user's reservations, {port: time handed out}, under an exclusive
    lock. Returns False where another process has it.

    Without this, two launchers on one machine, such as tests run side by side, drew the
    same port now and then, and the second child to bind it failed. Where the file is
    unwritable there is no reservation, and the bind still checks.
    """
    try:
        with open(RESERVATIONS, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            try:
                taken = {int(p): t for p, t in json.loads(f.read() or "{}").items()}
            except (ValueError, AttributeError):  # torn or foreign: start again
                taken = {}
            now = time.time()
            taken = {p: t for p, t in taken.items() if now - t < RESERVED_S}
            if port in taken:
                return False
            taken[port] = now
            f.seek(0)
            f.truncate()
            json.dump(taken, f)
    except OSError:  # unwritable: no reservation
        return True
    return True


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for port 0: Linux's ip_local_port_range, else
    49152, where the IANA dynamic range starts, as on macOS and Windows."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 49152
