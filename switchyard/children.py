"""The child processes that `switchyard serve` supervises, as do the tests and benchmarks
that start real services. Each is started with a ready pipe, pinned to GPUs, stopped
together with the others, and dies with its parent (PR_SET_PDEATHSIG), so none is
orphaned."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from functools import partial


class StartupError(RuntimeError):
    """A service that could not start, or exited: named, with its status."""


# What `serve` decides for each child: its role, rank, ports, peers and backend. A
# SWITCHYARD_* variable for one of these would be read by the child as its own default
# and override the topology serve chose, so children never see them.
_TOPOLOGY_ENV = frozenset(f"SWITCHYARD_{name}" for name in (
    "ATTENTION_GROUPS", "ATTENTION_HOST", "ATTENTION_PORT", "ATTENTION_RANK",
    "ATTENTION_RANKS", "DCP_INIT", "DCP_INTERLEAVE", "DCP_RANK", "DCP_SIZE",
    "DISPATCH_BACKEND", "DIST_INIT", "ENGINE", "EXPERT_ADDRESSES", "EXPERT_HOST",
    "EXPERT_PORT", "EXPERT_RANK", "EXPERT_RANKS", "HOST", "METRICS_PORT", "PORT",
    "READY_FD", "SERVICE_METRICS"))


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child service, without `_TOPOLOGY_ENV`."""
    return {**{k: v for k, v in os.environ.items() if k not in _TOPOLOGY_ENV}, **extra}


def _die_with_parent(parent: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above: no signal will come
        os._exit(1)


class Children:
    """Child processes that are all stopped together."""

    def __init__(self, gpus: int = 0) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.gpus = gpus  # GPUs to pin services to, round-robin (0: none)
        self._next_gpu = 0
        self._started: dict[str, tuple[list[str], dict[str, str]]] = {}  # name -> args, env

    def spawn(self, name: str, args: list[str], gpu: bool = False,
              env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen, int]:
        """Start `python -m switchyard ARGS --ready-fd W`, and return what `wait_ports`
        needs. With `gpu`, the child is pinned to the next GPU by CUDA_VISIBLE_DEVICES.
        `env` holds variables for this child only."""
        own = dict(env or {})
        if gpu and self.gpus:
            own["CUDA_VISIBLE_DEVICES"] = str(self._next_gpu % self.gpus)
            self._next_gpu += 1
        self._started[name] = (args, own)
        return self._popen(name, args, own)

    def _popen(self, name: str, args: list[str], own_env: dict[str, str]
               ) -> tuple[str, subprocess.Popen, int]:
        read_fd, write_fd = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "switchyard", *args, "--ready-fd", str(write_fd)],
            pass_fds=(write_fd,), preexec_fn=partial(_die_with_parent, os.getpid()),
            env=child_env(**own_env))
        os.close(write_fd)
        self.procs.append((name, proc))
        return name, proc, read_fd

    def respawn(self, name: str) -> int:
        """Start the child `name`, which has exited, again, with the same arguments, its
        ports included, and the same GPU, without waiting. Returns the read end of its ready
        pipe."""
        self.procs = [(n, p) for n, p in self.procs if n != name]
        return self._popen(name, *self._started[name])[2]

    @staticmethod
    def wait_ports(pending: tuple[str, subprocess.Popen, int], deadline: float
                   ) -> tuple[int, ...]:
        """The ports a spawned child reports once listening, by `deadline` (monotonic):
        its service port, then its /metrics port if it serves one."""
        name, proc, read_fd = pending
        with os.fdopen(read_fd) as ready:
            if not select.select([ready], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise StartupError(f"{name} did not start listening in time")
            return Children._reported(name, proc, ready.readline())

    def start_all(self, specs: list[tuple[str, list[str]]], timeout: float,
                  gpu: bool = False, env: dict[str, str] | None = None
                  ) -> list[tuple[int, ...]]:
        """Start every (name, ARGS) at once, and return their reported ports, in order.
        The pipes are watched together, so a child that dies is named at once, whichever it
        is. Otherwise ranks that wait in a rendezvous for it would time out first."""
        pending = [self.spawn(name, args, gpu, env) for name, args in specs]
        deadline = time.monotonic() + timeout
        pipes = {os.fdopen(fd): (i, name, proc) for i, (name, proc, fd) in enumerate(pending)}
        ports: dict[int, tuple[int, ...]] = {}
        try:
            while pipes:
                ready = select.select(list(pipes), [], [],
                                      max(0.0, deadline - time.monotonic()))[0]
                if not ready:
                    late = ", ".join(name for _, name, _ in pipes.values())
                    raise StartupError(f"{late} did not start listening in time")
                for pipe in ready:
                    i, name, proc = pipes.pop(pipe)
                    with pipe:
                        ports[i] = self._reported(name, proc, pipe.readline())
        finally:
            for pipe in pipes:
                pipe.close()
        return [ports[i] for i in range(len(pending))]

    @staticmethod
    def _reported(name: str, proc: subprocess.Popen, line: str) -> tuple[int, ...]:
        """The ports in a child's ready line, or EOF (empty) if it died before listening."""
        words = line.split()
        if not words or not all(w.isdigit() for w in words):
            proc.wait()
            raise StartupError(f"{name} exited with status {proc.returncode} before listening")
        return tuple(map(int, words))

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise StartupError(f"{name} exited with status {proc.returncode}")

    def reap(self) -> list[tuple[str, int]]:
        """The children that exited since the last call, with their exit status, without
        waiting. Processes these did not start are reaped and left out: a `serve` that is
        a container's PID 1 inherits orphans, such as a killed service's own children."""
        exited = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return exited
            if pid == 0:
                return exited
            if (name := next((n for n, p in self.procs if p.pid == pid), None)) is not None:
                exited.append((name, os.waitstatus_to_exitcode(status)))

    def kill(self, names: list[str]) -> None:
        """SIGKILL the children `names` and wait for them. They are the partners of one
        that died, stuck in a rendezvous or a collective with it, where a graceful stop
        would wait on it."""
        procs = [p for n, p in self.procs if n in names]
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for _, proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
