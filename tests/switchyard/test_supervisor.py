"""`serve`'s restart policy (switchyard/supervisor.py) against scripted exits: what is
restarted, when, and that every child is still watched while one restarts. (A real
expert service killed under `serve`: tests/e2e/test_expert_services.py.)"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from switchyard.children import StartupError
from switchyard.supervisor import supervise


class ScriptedChildren:
    """`reap` gives each step's exits once its condition holds (nothing until then);
    `respawn` opens a ready pipe and runs `on_respawn` with its write end (a test writes
    a ready line, or closes it as a child that died before listening)."""

    def __init__(self, on_respawn: Callable[[str, int], None]) -> None:
        self.steps: list[tuple[Callable[[], bool], list[tuple[str, int]]]] = []
        self.on_respawn, self.respawned = on_respawn, []
        self.killed: list[list[str]] = []

    def then(self, *exits: tuple[str, int], once: Callable[[], bool] = lambda: True
             ) -> ScriptedChildren:
        self.steps.append((once, list(exits)))
        return self

    def reap(self) -> list[tuple[str, int]]:
        if self.steps and self.steps[0][0]():
            return self.steps.pop(0)[1]
        return []

    def kill(self, names: list[str]) -> None:
        self.killed.append(names)

    def respawn(self, name: str) -> int:
        self.respawned.append(name)
        read_fd, write_fd = os.pipe()
        self.on_respawn(name, write_fd)
        return read_fd


def experts_only(name: str) -> tuple[str, ...]:
    return (name,) if name.startswith("expert rank") else ()


def write_ready(name: str, fd: int) -> None:
    os.write(fd, b"7100 9400\n")
    os.close(fd)


@pytest.mark.parametrize(("exit_", "why"), [(("gateway", 1), "not restartable"),
                                            (("expert rank 0", 0), "a clean exit")])
def test_what_is_not_restarted_ends_the_topology(exit_: tuple[str, int], why: str) -> None:
    children = ScriptedChildren(write_ready).then(exit_)
    with pytest.raises(StartupError, match=f"{exit_[0]} exited with status {exit_[1]}"):
        supervise(children, experts_only)
    assert children.respawned == [], why


def test_a_failed_expert_service_is_started_again_and_the_rest_still_watched(
        capsys: pytest.CaptureFixture[str]) -> None:
    children = ScriptedChildren(write_ready).then(("expert rank 1", -9))
    children.then(("attention group 0", 1), once=lambda: bool(children.respawned))
    with pytest.raises(StartupError, match="attention group 0 exited with status 1"):
        supervise(children, experts_only)
    assert children.respawned == ["expert rank 1"]
    assert "expert rank 1 exited with status -9; starting it again in 0.1 s" in \
        capsys.readouterr().err
    assert children.killed == [[]]  # no partners


def test_a_gateway_exit_is_seen_while_an_expert_service_waits_to_restart() -> None:
    """The restart is due 0.1 s later; the gateway's exit in between ends it all (the
    supervisor used to wait for the restarted child, blind to the others)."""
    children = ScriptedChildren(write_ready).then(("expert rank 0", 1)).then(("gateway", 1))
    with pytest.raises(StartupError, match="gateway exited with status 1"):
        supervise(children, experts_only)
    assert children.respawned == []


def until_the_gateway_exits(children: ScriptedChildren,
                            unit_of: Callable[[str], tuple[str, ...]],
                            loading: list[int]) -> None:
    """`supervise` until the scripted gateway's exit ends it; then close the ready pipes
    that children still loading hold."""
    try:
        with pytest.raises(StartupError, match="gateway exited with status 1"):
            supervise(children, unit_of)
    finally:
        for fd in loading:
            os.close(fd)


@pytest.mark.timeout(30)
def test_a_gateway_exit_is_seen_while_a_restarted_service_is_still_loading() -> None:
    """The restarted child holds its ready pipe open (loading, not yet listening); the
    gateway's exit meanwhile ends it all (a supervisor blocked on that pipe would hang)."""
    loading: list[int] = []
    children = ScriptedChildren(lambda name, fd: loading.append(fd))
    children.then(("expert rank 0", 1))
    children.then(("gateway", 1), once=lambda: bool(children.respawned))
    until_the_gateway_exits(children, experts_only, loading)
    assert children.respawned == ["expert rank 0"] and loading


def test_a_crash_loop_backs_off_doubling(capsys: pytest.CaptureFixture[str]) -> None:
    """Each restart dies before listening (its pipe ends without a ready line): waits of
    0.1, 0.2, 0.4 s, as Docker's restart policy."""
    children = ScriptedChildren(lambda name, fd: os.close(fd)).then(("expert rank 0", 1))
    for n in (1, 2):
        children.then(("expert rank 0", 1), once=lambda n=n: len(children.respawned) == n)
    children.then(("gateway", 1), once=lambda: len(children.respawned) == 3)
    with pytest.raises(StartupError, match="gateway"):
        supervise(children, experts_only)
    err = capsys.readouterr().err
    assert [line.rsplit(" ", 2)[-2] for line in err.splitlines()] == ["0.1", "0.2", "0.4"]


def test_a_service_that_ran_long_enough_restarts_at_the_first_delay(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Docker's rule: the doubling starts over once a restarted child has been up a
    while (here: at once), so a rare crash never waits 30 s."""
    from switchyard import supervisor

    monkeypatch.setattr(supervisor, "STEADY_S", 0.0)
    children = ScriptedChildren(write_ready).then(("expert rank 0", 1))
    children.then(("expert rank 0", 1), once=lambda: len(children.respawned) == 1)
    children.then(("gateway", 1), once=lambda: len(children.respawned) == 2)
    with pytest.raises(StartupError, match="gateway"):
        supervise(children, experts_only)
    err = capsys.readouterr().err
    assert [line.rsplit(" ", 2)[-2] for line in err.splitlines()] == ["0.1", "0.1"]


def test_processes_serve_did_not_start_are_reaped_and_left_out() -> None:
    """A `serve` that is a container's PID 1 inherits orphans; their exits are not its
    children's. (In a process of its own: reaping any child here would take pytest's.)"""
    import subprocess
    import sys

    script = """
import os, subprocess, sys
from switchyard.children import Children
stray = subprocess.Popen([sys.executable, "-c", "pass"])  # not one of Children's
os.waitid(os.P_PID, stray.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
print(Children().reap())
try:
    os.waitpid(stray.pid, os.WNOHANG)
except ChildProcessError:
    print("reaped")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["[]", "reaped"], out.stderr


DCP_GROUP = ("attention group 0", "attention group 0 DCP rank 1")


def dcp_group(name: str) -> tuple[str, ...]:
    return DCP_GROUP if name in DCP_GROUP else ()


@pytest.mark.parametrize("dies", DCP_GROUP)
def test_a_unit_restarts_together_when_one_of_its_members_dies(
        dies: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A DCP group's leader or peer: its partner is killed (it would wait in their
    collectives forever) and both start again, together (their rendezvous needs both)."""
    children = ScriptedChildren(write_ready).then((dies, -9))
    children.then(("gateway", 1), once=lambda: len(children.respawned) == 2)
    with pytest.raises(StartupError, match="gateway"):
        supervise(children, dcp_group)
    partner = next(n for n in DCP_GROUP if n != dies)
    assert children.killed == [[partner]]
    assert children.respawned == list(DCP_GROUP)
    assert f"{dies} exited with status -9; starting it (and with it {partner}) again" in \
        capsys.readouterr().err


def test_a_partner_that_dies_with_its_unit_does_not_restart_it_twice() -> None:
    """Both ranks' exits in one round (the peer saw its leader go): one restart."""
    children = ScriptedChildren(write_ready).then((DCP_GROUP[0], -9), (DCP_GROUP[1], 1))
    children.then(("gateway", 1), once=lambda: len(children.respawned) >= 2)
    with pytest.raises(StartupError, match="gateway"):
        supervise(children, dcp_group)
    assert children.respawned == list(DCP_GROUP) and len(children.killed) == 1


def test_a_signal_death_is_named_before_the_partner_that_exited_on_seeing_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The peer SIGKILLed; the leader's collective fails at once and it exits with status
    3 before `serve` looks: both in one round, the leader's first. The log names the
    killed peer as the cause."""
    children = ScriptedChildren(write_ready).then((DCP_GROUP[0], 3), (DCP_GROUP[1], -9))
    children.then(("gateway", 1), once=lambda: len(children.respawned) >= 2)
    with pytest.raises(StartupError, match="gateway"):
        supervise(children, dcp_group)
    assert children.respawned == list(DCP_GROUP) and len(children.killed) == 1
    assert f"{DCP_GROUP[1]} exited with status -9; starting it (and with it " \
        f"{DCP_GROUP[0]}) again" in capsys.readouterr().err


def test_a_member_that_dies_while_its_unit_restarts_restarts_the_unit_again(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The peer dies before listening (its pipe closes; the leader still loads): the
    leader is killed again and the unit waits the doubled delay."""
    loading: list[int] = []

    def respawn(name: str, fd: int) -> None:
        if name == DCP_GROUP[1] and len(children.respawned) == 2:
            os.close(fd)  # the first restart's peer dies before listening
        elif len(children.respawned) > 2:
            write_ready(name, fd)
        else:
            loading.append(fd)

    children = ScriptedChildren(respawn).then((DCP_GROUP[1], -9))
    children.then((DCP_GROUP[1], 1), once=lambda: len(children.respawned) == 2)
    children.then(("gateway", 1), once=lambda: len(children.respawned) == 4)
    until_the_gateway_exits(children, dcp_group, loading)
    assert children.killed == [[DCP_GROUP[0]], [DCP_GROUP[0]]]
    assert children.respawned == [*DCP_GROUP, *DCP_GROUP]
    err = capsys.readouterr().err
    assert [line.rsplit(" ", 2)[-2] for line in err.splitlines()] == ["0.1", "0.2"]


def test_serve_restarts_what_meets_in_a_rendezvous_together() -> None:
    """`serve`'s units: a DCP group's ranks together, the rest of an rpc topology alone,
    a collective backend's world whole; the gateway alone."""
    from argparse import Namespace

    from switchyard.launcher import _restart_units

    names = ["expert rank 0", "expert rank 1", "attention group 0",
             "attention group 0 DCP rank 1", "attention group 1",
             "attention group 1 DCP rank 1", "gateway"]
    rpc = _restart_units(Namespace(dispatch_backend="rpc"), names)
    assert rpc["expert rank 1"] == ("expert rank 1",)
    assert rpc["attention group 0 DCP rank 1"] == rpc["attention group 0"] == (
        "attention group 0", "attention group 0 DCP rank 1")
    assert rpc["attention group 1"] == ("attention group 1", "attention group 1 DCP rank 1")
    assert rpc["gateway"] == ("gateway",)
    world = _restart_units(Namespace(dispatch_backend="torch"), [
        "expert rank 0", "attention group 0", "attention group 1", "gateway"])
    assert set(world.values()) == {("expert rank 0", "attention group 0", "attention group 1"),
                                   ("gateway",)}
