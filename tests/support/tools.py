"""Third-party programs and references some tests need (Chromium, a trace receiver,
torchao's MX quantizer, Triton). Where one is missing the test is skipped with the reason,
unless SWITCHYARD_REQUIRE_TEST_TOOLS=1 (set by CI, which installs them) makes that a
failure."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from common.ports import free_port
from tests.support import ROOT

CHROMIUM = os.environ.get("SWITCHYARD_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("SWITCHYARD_CHROMEDRIVER", "/usr/bin/chromedriver")


def missing(what: str, how: str = "scripts/install-test-tools installs it") -> None:
    """Skip (or, where the tools are required, fail) for want of `what`; in a test or at
    a test module's top."""
    message = f"{what} is not installed ({how})"
    if os.environ.get("SWITCHYARD_REQUIRE_TEST_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message, allow_module_level=True)


@contextmanager
def chromium(width: int = 1400, height: int = 800) -> Iterator[object]:
    """Headless Debian Chromium driven by Selenium through Debian's chromedriver. Every
    host but loopback fails to resolve, so a page that needs the network fails here."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing("selenium")
    for path in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(path):
            missing(path)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    with tempfile.TemporaryDirectory() as profile:
        for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                     "--no-first-run", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync",
                     "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                     f"--user-data-dir={profile}", f"--window-size={width},{height}"):
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        try:
            yield driver
        finally:
            driver.quit()


TOOLS = Path(os.environ.get("SWITCHYARD_TOOLS_DIR", ROOT / ".tools")) / "bin"
PROMTOOL, PROMETHEUS = TOOLS / "promtool", TOOLS / "prometheus"


def prometheus_tool(path: Path) -> str:
    """`path` (promtool or prometheus) if installed, else skip (or fail)."""
    if not os.access(path, os.X_OK):
        missing(f"Prometheus' {path.name} ({path})")
    return str(path)


@contextmanager
def prometheus(config: str, rules: Path, timeout: float = 60.0) -> Iterator[str]:
    """Prometheus with `config` (YAML; `rule_files` are set to `rules`) on a free loopback
    port, its data in a temporary folder; yields its base URL, stops it afterwards."""
    binary = prometheus_tool(PROMETHEUS)
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        Path(tmp, "prometheus.yml").write_text(f"{config}\nrule_files: [{rules}]\n")
        with open(f"{tmp}/prometheus.log", "wb") as log:
            proc = subprocess.Popen(
                [binary, f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/data",
                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            log_text = Path(tmp, "prometheus.log").read_text
            wait_until(lambda: _ready(f"{base}/-/ready", proc), timeout,
                       lambda: f"Prometheus did not start: {log_text()}")
            yield base
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Terminate a tool started in its own session; kill its group if it lingers."""
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _ready(url: str, proc: subprocess.Popen) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"exited with status {proc.returncode}")
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


PHOENIX = os.environ.get("SWITCHYARD_PHOENIX",
                         str(ROOT / ".venv-phoenix/bin/phoenix"))


class Phoenix:
    """A running Arize Phoenix: OTLP/HTTP in at `traces_url`, spans out through its REST API.

    Phoenix keeps spans, attributes and parents, but drops span links and resource
    attributes on ingest (so `service.name` cannot be read back from it)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.traces_url = f"{base}/v1/traces"

    def spans(self, project: str = "default") -> list[dict]:
        """Every span of `project` so far (REST pages followed; [] before the first)."""
        out: list[dict] = []
        params: dict[str, object] = {"limit": 1000}
        with httpx.Client(base_url=self.base, timeout=10) as client:
            while True:
                r = client.get(f"/v1/projects/{project}/spans", params=params)
                if r.status_code == 404:  # the project appears with its first span
                    return out
                r.raise_for_status()
                body = r.json()
                out += body["data"]
                if not body.get("next_cursor"):
                    return out
                params["cursor"] = body["next_cursor"]


@contextmanager
def phoenix(timeout: float = 120.0) -> Iterator[Phoenix]:
    """Start Phoenix on a free loopback port with its own working directory, no telemetry
    and no downloads; stop it (and anything it started) afterwards."""
    if not os.access(PHOENIX, os.X_OK):
        missing(f"Arize Phoenix ({PHOENIX})")
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
        (Path(tmp) / "tmp").mkdir()
        env.update(PHOENIX_HOST="127.0.0.1", PHOENIX_PORT=str(port), PHOENIX_GRPC_PORT="0",
                   PHOENIX_WORKING_DIR=f"{tmp}/work", PHOENIX_TELEMETRY_ENABLED="false",
                   PHOENIX_ALLOW_EXTERNAL_RESOURCES="false", TMPDIR=f"{tmp}/tmp", HOME=tmp)
        with open(f"{tmp}/phoenix.log", "wb") as log:
            proc = subprocess.Popen([PHOENIX, "serve"], cwd=tmp, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_until(lambda: _ready(f"{base}/healthz", proc), timeout,
                       lambda: f"Phoenix did not start: {Path(tmp, 'phoenix.log').read_text()}")
            yield Phoenix(base)
        finally:
            _stop(proc)


def wait_until(ready: Callable[[], object], timeout: float,
               describe: Callable[[], str] = lambda: "condition") -> object:
    """Poll `ready` (backing off from 50 ms to 1 s) until it returns something truthy;
    fail with `describe()` after `timeout` seconds."""
    deadline, delay = time.monotonic() + timeout, 0.05
    while time.monotonic() < deadline:
        if value := ready():
            return value
        select.select([], [], [], delay)
        delay = min(2 * delay, 1.0)
    raise TimeoutError(f"not within {timeout:g}s: {describe()}")
