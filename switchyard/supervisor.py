"""What `switchyard serve` does while the topology runs: the restart policy.

A service that fails with a non-zero exit is started again on its own ports, as compose's
`restart: on-failure` does. The delay doubles from 0.1 s up to 30 s with each failure, and
starts over once the service has run 10 s, which is Docker's rule. Services restart by
*unit*. The ones that meet in a rendezvous, a DCP group's ranks or a collective backend's
whole world, cannot go on without the one that died, so its partners are killed and the
unit starts again together. Meanwhile the gateway fails the unit's requests over, and
experts go to their replicas or the attention services hold their steps. A gateway that
dies loses its clients' connections, and comes back on its port. A child with no unit,
and any that exits cleanly, ends the topology. Every child keeps being watched while a
unit restarts.

The units are: an `rpc` expert service, and an attention group without DCP, each a unit of
one; a DCP group's ranks, one unit; a collective backend's world (every attention and expert
rank), one unit; and the gateway, a unit of one. A service that cannot start at all, at
`serve`'s start, stops them all too.
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from switchyard.children import StartupError

FIRST_DELAY_S, LONGEST_DELAY_S, STEADY_S = 0.1, 30.0, 10.0
POLL_S = 0.1  # how often exits are looked for (signals end the wait at once)

Unit = tuple[str, ...]  # the children that restart together, by name


class Supervised(Protocol):
    def reap(self) -> list[tuple[str, int]]: ...
    def kill(self, names: list[str]) -> None: ...
    def respawn(self, name: str) -> int: ...


@dataclass
class _Restart:
    delay: float = FIRST_DELAY_S / 2  # doubled before its first use
    due: float | None = None  # when the next start is, while the unit waits
    ready_fds: list[int] = field(default_factory=list)  # ready pipes not yet answered
    up_since: float | None = None  # when its last member reported listening


def supervise(children: Supervised, unit_of: Callable[[str], Unit]) -> None:
    """Run until a child exits that may not be restarted, then raise `StartupError` naming
    it. `unit_of(name)` gives the children restarted with `name`, itself among them, or ()
    for one that is not restarted."""
    restarts: dict[Unit, _Restart] = {}
    while True:
        # A signal's death first: a partner that saw it go exits on its own in the same
        # round, and the log should name the cause, not the partner.
        for name, status in sorted(children.reap(), key=lambda exit_: exit_[1] >= 0):
            unit = unit_of(name)
            if status == 0 or not unit:
                raise StartupError(f"{name} exited with status {status}")
            r = restarts.setdefault(unit, _Restart())
            if r.due is not None:
                continue  # a partner of one that died just before: already stopped
            _failed(children, name, status, unit, r)
        for unit, r in restarts.items():
            if r.due is not None and time.monotonic() >= r.due:
                r.due, r.ready_fds = None, [children.respawn(n) for n in unit]
        _wait_ready(restarts)


def _failed(children: Supervised, name: str, status: int, unit: Unit, r: _Restart) -> None:
    steady = r.up_since is not None and time.monotonic() - r.up_since >= STEADY_S
    r.delay = FIRST_DELAY_S if steady else min(2 * r.delay, LONGEST_DELAY_S)
    r.due, r.up_since = time.monotonic() + r.delay, None
    _close(r)
    partners = [n for n in unit if n != name]
    children.kill(partners)
    also = f" (and with it {', '.join(partners)})" if partners else ""
    print(f"switchyard serve: {name} exited with status {status}; starting it{also} "
          f"again in {r.delay:.1f} s", file=sys.stderr, flush=True)


def _wait_ready(restarts: dict[Unit, _Restart]) -> None:
    """Wait up to `POLL_S` for restarted children's ready lines. A unit whose members all
    wrote theirs is up. A pipe that ends without one is a child that exited; it is reaped
    next round."""
    waiting = {fd: r for r in restarts.values() for fd in r.ready_fds}
    readable = select.select(list(waiting), [], [], POLL_S)[0] if waiting else []
    if not waiting:
        time.sleep(POLL_S)
    for fd in readable:
        r = waiting[fd]
        r.ready_fds.remove(fd)
        if os.read(fd, 64) and not r.ready_fds:
            r.up_since = time.monotonic()
        os.close(fd)


def _close(r: _Restart) -> None:
    for fd in r.ready_fds:
        os.close(fd)
    r.ready_fds = []
