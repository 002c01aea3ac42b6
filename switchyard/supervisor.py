"""What `switchyard serve` does while the topology runs: the restart policy.

An `rpc` expert service that fails (a non-zero exit) is started again on its own ports,
as compose's `restart: on-failure` does, after a delay that doubles from 0.1 s up to
30 s with each failure and starts over once it has run 10 s (Docker's rule). Meanwhile
its experts go to their replicas, if any, or its layer calls fail. Any other child that
exits, and any that exits cleanly, ends the topology. Every child keeps being watched
while one restarts.
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from switchyard.children import Children, StartupError

FIRST_DELAY_S, LONGEST_DELAY_S, STEADY_S = 0.1, 30.0, 10.0
POLL_S = 0.1  # how often exits are looked for (signals end the wait at once)


@dataclass
class _Restart:
    delay: float = FIRST_DELAY_S / 2  # doubled before its first use
    due: float | None = None  # when the next start is, while one waits
    ready_fd: int | None = None  # its ready pipe, until it listens
    up_since: float | None = None  # when it last reported listening


def supervise(children: Children, restartable: Callable[[str], bool]) -> None:
    """Until a child exits that may not be restarted: raises `StartupError` naming it."""
    restarts: dict[str, _Restart] = {}
    while True:
        for name, status in children.reap():
            if status == 0 or not restartable(name):
                raise StartupError(f"{name} exited with status {status}")
            r = restarts.setdefault(name, _Restart())
            steady = r.up_since is not None and time.monotonic() - r.up_since >= STEADY_S
            r.delay = FIRST_DELAY_S if steady else min(2 * r.delay, LONGEST_DELAY_S)
            r.due, r.up_since = time.monotonic() + r.delay, None
            _close(r)
            print(f"switchyard serve: {name} exited with status {status}; starting it "
                  f"again in {r.delay:.1f} s", file=sys.stderr, flush=True)
        for name, r in restarts.items():
            if r.due is not None and time.monotonic() >= r.due:
                r.due, r.ready_fd = None, children.respawn(name)
        _wait_ready(restarts)


def _wait_ready(restarts: dict[str, _Restart]) -> None:
    """Up to `POLL_S` for a restarted child's ready line; one that wrote it is up (one
    whose pipe ends without it has exited, and is reaped next round)."""
    waiting = {r.ready_fd: r for r in restarts.values() if r.ready_fd is not None}
    readable = select.select(list(waiting), [], [], POLL_S)[0] if waiting else []
    if not waiting:
        time.sleep(POLL_S)
    for fd in readable:
        r = waiting[fd]
        if os.read(fd, 64):
            r.up_since = time.monotonic()
        _close(r)


def _close(r: _Restart) -> None:
    if r.ready_fd is not None:
        os.close(r.ready_fd)
        r.ready_fd = None
