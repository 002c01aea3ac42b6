"""Run `switchyard serve` as a real process tree on loopback, for `switchyard eval` and
tests."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, read from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def service_name(args: list[str]) -> str | None:
    """What a child of `serve` is, from its command line (`python -m switchyard ROLE
    FLAGS`), named so that a restarted child has its old name:

    - "gateway";
    - "expert rank R", where in a collective world R is its --world-rank less the
      attention ranks;
    - "attention group :PORT", where PORT is the port its gateway connects to, or with DCP
      its group's rendezvous port;
    - "attention group :PORT DCP rank R" for a DCP peer.

    Returns None for another process.
    """
    if "gateway" in args:
        return "gateway"
    if "expert" in args:
        if (world := _flag(args, "--world-rank")) is not None:
            return f"expert rank {int(world) - int(_flag(args, '--attention-ranks') or 1)}"
        return f"expert rank {_flag(args, '--rank')}"
    if "attention" not in args:
        return None
    peer = f" DCP rank {rank}" if (rank := _flag(args, "--dcp-rank")) not in (None, "0") \
        else ""
    group = _flag(args, "--dcp-init") or f":{_flag(args, '--port')}"
    return f"attention group :{group.rpartition(':')[2]}{peer}"


def _flag(args: list[str], flag: str) -> str | None:
    """The last value given to `flag`, by argparse's rule, or None."""
    at = [i for i, a in enumerate(args[:-1]) if a == flag]
    return args[at[-1] + 1] if at else None


def services(pid: int) -> dict[str, int]:
    """The services (`service_name`) among the children of `pid`, to their process ids."""
    out = {}
    for child in child_pids(pid):
        try:
            args = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue  # gone meanwhile
        if (name := service_name(args)) is not None:
            out[name] = child
    return out


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat fields after the command name, from field 3 on, or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot. With the pid, this is its
    identity."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def alive(pid: int, started: int | None = None) -> bool:
    """Whether `pid` runs and is not a zombie. With `started`, also whether it is still
    the process that started then, not a later one, or a thread, that reuses the number."""
    fields = _stat(pid)
    if fields is None or fields[0] == "Z":
        return False
    return started is None or int(fields[19]) == started


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Served:
    """`switchyard serve ARGS --port 0`; `.url` is the base URL once healthy."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 timeout: float = 180.0, background: bool = False) -> None:
        """`background`: start it as a shell starts a background job, SIGINT ignored."""
        # stderr goes to a file: a pipe nobody drains would block the services when full.
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "switchyard", "serve", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
            env={**os.environ, **(env or {})},
            preexec_fn=_ignore_sigint if background else None)
        self.url = self._wait_for_url(timeout)
        self.children = child_pids(self.proc.pid)
        self._started = {pid: start_time(pid) for pid in self.children}

    def services(self) -> dict[str, int]:
        """Each service running now (`service_name`) to its process id."""
        return services(self.proc.pid)

    def service(self, prefix: str) -> int:
        """The process id of the first service, by name, that starts with `prefix`."""
        running = self.services()
        found = sorted(n for n in running if n.startswith(prefix))
        if not found:
            raise LookupError(f"no service {prefix!r} among {sorted(running)}")
        return running[found[0]]

    def children_alive(self) -> list[bool]:
        """For each child the launcher started, whether that very process still runs."""
        return [alive(pid, self._started[pid]) for pid in self.children]

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], deadline - time.monotonic())
            line = self.proc.stdout.readline() if ready else ""
            if m := re.search(r"at (https?://\S+)/v1", line):
                return m.group(1)
            if not line and self.proc.poll() is not None:
                break
        log = self.stderr()
        self.stop()
        raise RuntimeError(f"switchyard serve did not come up: {log}")

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def split_serve_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """`TOOL_FLAGS -- SERVE_FLAGS` -> (TOOL_FLAGS, SERVE_FLAGS), for client tools."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def against_gateway(url: str | None, serve_flags: list[str], fn: Callable[[str], T]) -> T:
    """fn(base URL) on the gateway at `url`, or on a `switchyard serve SERVE_FLAGS`
    started, and stopped, for the purpose."""
    if url:
        return fn(url)
    with Served(serve_flags, timeout=600) as served:
        return fn(served.url)
