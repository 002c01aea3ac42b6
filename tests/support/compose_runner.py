"""Run a compose file's Switchyard services as local processes (no Docker engine here).

Each service's `command` runs with its `environment`, after compose-style `${VAR:-default}`
interpolation: service hostnames become 127.0.0.1, every port a service listens on is
remapped to a free local one (the same rewrite applies to references from other services
and to healthchecks), the model volume's container path becomes its host path, each
secret's /run/secrets/ path a local file holding a secret made for the run, and GPU
reservations are ignored. Third-party images (Jaeger, Prometheus) are skipped. Services
start in `depends_on` order, each waiting until its dependencies pass their own
healthchecks, as compose does.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from common.auth import ClusterSecret
from common.ports import free_port
from tests.support.tools import wait_until

_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value: object, env: dict[str, str]) -> object:
    """Compose's `${VAR}` / `${VAR:-default}` in every string of a document."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


class LocalCompose:
    """The Switchyard services of `doc` (already interpolated) that compose starts under
    `profiles`: those with no profile, and those with one of them."""

    def __init__(self, doc: dict, profiles: set[str]) -> None:
        self.services = {
            name: s for name, s in doc["services"].items()
            if (set(s.get("profiles", [])) & profiles or "profiles" not in s) and
            s.get("command", [""])[0] == "switchyard"}
        self.hosts = set(doc["services"])
        self.ports: dict[tuple[str, int], int] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = tempfile.TemporaryDirectory()
        # compose's secrets, where compose mounts them -> a local file of a fresh secret
        self.secrets = {f"/run/secrets/{n}": str(ClusterSecret.generate().write(
            Path(self.logs.name, f"secret-{n}"))) for n in doc.get("secrets", {})}

    def local_port(self, service: str, port: int) -> int:
        key = (service, port)
        if key not in self.ports:
            self.ports[key] = free_port()
        return self.ports[key]

    def _rewrite(self, service: str, text: str) -> str:
        """Another service's `host:port` (or this one's 127.0.0.1:port) -> 127.0.0.1:local."""
        def repl(m: re.Match) -> str:
            host = service if m.group(1) in ("127.0.0.1", "localhost") else m.group(1)
            return f"127.0.0.1:{self.local_port(host, int(m.group(2)))}"

        names = "|".join(map(re.escape, sorted(self.hosts | {"127.0.0.1", "localhost"},
                                               key=len, reverse=True)))
        return re.sub(rf"\b({names}):(\d+)\b", repl, text)

    def command(self, name: str) -> list[str]:
        service = self.services[name]
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service.get("volumes", [])}
        out: list[str] = []
        args = list(service["command"])
        for i, arg in enumerate(args):
            if i and args[i - 1] in ("--port", "--metrics-port"):
                arg = str(self.local_port(name, int(arg)))
            elif i and args[i - 1] == "--host" and arg == "0.0.0.0":
                arg = "127.0.0.1"
            else:
                arg = mounts.get(arg, self._rewrite(name, arg))
            out.append(arg)
        switchyard = Path(sys.executable).with_name("switchyard")
        return [str(switchyard), *out[1:]]

    def environment(self, name: str) -> dict[str, str]:
        env = {k: self.secrets.get(str(v), self._rewrite(name, str(v)))
               for k, v in self.services[name].get("environment", {}).items()}
        return {**os.environ, **env}

    def healthcheck(self, name: str) -> list[str]:
        test = self.services[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "switchyard", test
        switchyard = Path(sys.executable).with_name("switchyard")
        return [str(switchyard), *(self._rewrite(name, t) for t in test[2:])]

    def healthy(self, name: str) -> bool:
        """One run of the service's healthcheck, failing past its `timeout` as Docker's."""
        proc = self.procs[name]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode}: "
                               f"{self.log(name)[-3000:]}")
        timeout = float(self.services[name]["healthcheck"]["timeout"].removesuffix("s"))
        try:
            return subprocess.run(self.healthcheck(name), capture_output=True,  # in its
                                  env=self.environment(name),  # container's environment
                                  timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def log(self, name: str) -> str:
        return Path(self.logs.name, f"{name}.log").read_text(errors="replace")

    def start(self, name: str) -> None:
        with open(Path(self.logs.name, f"{name}.log"), "wb") as log:
            self.procs[name] = subprocess.Popen(
                self.command(name), env=self.environment(name), stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def up(self, timeout: float = 300.0) -> None:
        """Start every service once its dependencies are healthy; wait for all."""
        pending = dict(self.services)
        while pending:
            ready = [n for n, s in pending.items()
                     if all(d in self.procs for d in s.get("depends_on", {}))]
            assert ready, f"depends_on cannot be satisfied: {sorted(pending)}"
            for name in ready:
                for dep in self.services[name].get("depends_on", {}):
                    wait_until(lambda dep=dep: self.healthy(dep), timeout,
                               lambda dep=dep: f"{dep} healthy")
                self.start(name)
                del pending[name]
        for name in self.services:
            wait_until(lambda name=name: self.healthy(name), timeout,
                       lambda name=name: f"{name} healthy")

    def down(self) -> None:
        """Stop every service's whole process group (a `serve` has children of its own)."""
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.logs.cleanup()

    def __enter__(self) -> LocalCompose:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
