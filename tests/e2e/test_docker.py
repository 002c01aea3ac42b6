"""The compose deployment under a real Docker engine, as the README's two commands run it:
the images scripts/docker-prepare builds on a local Debian base, and the committed
deploy/compose.cpu.yaml (`switchyard compose --device cpu --network host`: every container
on the host's network, on loopback, as the engine has no bridge) started by Debian's
docker-compose with deploy/compose.local.yaml's stand-ins for Jaeger (Arize Phoenix) and
Prometheus (Debian's).

- The `cpu` profile (one container, `switchyard serve`) answers the README's curl.
- The services on the CPU (`--device cpu`: gateway, attention, two expert services, each
  expert on both) answer under load while an expert container's process, then the
  attention container's, is SIGKILLed: no request fails, and the restart policy brings
  each back. Prometheus scrapes every service and returns the per-expert series to a
  PromQL query; Phoenix has the spans.

Each step is logged (stderr, and `$SWITCHYARD_DOCKER_LOG` when set: `.ci/run` prints it).
Skipped without an engine and the images (`scripts/docker-prepare`, as root), unless
SWITCHYARD_REQUIRE_TEST_TOOLS=1."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from switchyard.demo_task import Problem, is_correct, problems
from tests.support import ROOT
from tests.support.tools import missing, wait_until

pytestmark = pytest.mark.timeout(1200)

IMAGE = os.environ.get("SWITCHYARD_IMAGE", "switchyard:cpu")
STAND_INS = ("switchyard-phoenix:local", "switchyard-prometheus:local")
URL = "http://127.0.0.1:8000"  # the front door on the host's network
PROMETHEUS, PHOENIX = "http://127.0.0.1:9090", "http://127.0.0.1:4318"


def log(text: str) -> None:
    line = f"[docker {time.strftime('%H:%M:%S')}] {text}"
    print(line, file=sys.stderr, flush=True)
    if path := os.environ.get("SWITCHYARD_DOCKER_LOG"):
        with open(path, "a") as f:
            f.write(line + "\n")


def _docker_ready() -> None:
    for exe in ("docker", "docker-compose"):
        if shutil.which(exe) is None:
            missing(exe, "scripts/docker-prepare installs it")
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode:
        missing("a running Docker engine", "scripts/docker-prepare starts one, as root")
    for image in (IMAGE, *STAND_INS):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True,
                          timeout=60).returncode:
            missing(f"the image {image}", "scripts/docker-prepare builds it")


class Stack:
    """A compose project of deploy/compose.cpu.yaml with the stand-ins' override, its
    settings the defaults but `env` (and the gateway on loopback); `down -v` at the end."""

    def __init__(self, project: str, env: dict[str, str]) -> None:
        self.files = ["-f", str(ROOT / "deploy/compose.cpu.yaml"),
                      "-f", str(ROOT / "deploy/compose.local.yaml")]
        self.project = project
        unset = {k for k in os.environ if k.startswith(("SWITCHYARD_", "COMPOSE_"))}
        self.env = {**{k: v for k, v in os.environ.items() if k not in unset},
                    "SWITCHYARD_IMAGE": IMAGE, "SWITCHYARD_HOST": "127.0.0.1", **env}

    def compose(self, *args: str, timeout: float = 300) -> str:
        out = subprocess.run(["docker-compose", "-p", self.project, *self.files, *args],
                             capture_output=True, text=True, env=self.env, timeout=timeout)
        assert out.returncode == 0, f"docker-compose {' '.join(args)}: {out.stderr}"
        return out.stdout

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).strip()

    def state(self, service: str) -> dict:
        out = subprocess.run(["docker", "inspect", self.container(service)],
                             capture_output=True, text=True, timeout=60, check=True)
        return json.loads(out.stdout)[0]

    def healthy(self, service: str) -> bool:
        state = self.state(service)["State"]
        return state["Running"] and state.get("Health", {}).get("Status") == "healthy"

    def up(self, *args: str, wait_for: list[str]) -> None:
        start = time.monotonic()
        self.compose(*args)
        for service in wait_for:
            wait_until(lambda s=service: self.healthy(s), 600,
                       lambda s=service: f"{s} not healthy: {self.compose('logs', s)[-3000:]}")
        log(f"{self.project}: up and healthy in {time.monotonic() - start:.0f} s: "
            f"{', '.join(wait_for)}")

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", timeout=300)


@pytest.fixture(scope="module")
def docker() -> None:
    _docker_ready()


def readme_curl() -> tuple[str, str]:
    """The README's chat request (curl) and the content it promises."""
    text = (ROOT / "README.md").read_text()
    curl = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S)
                if b.startswith("curl -s http://127.0.0.1:8000/v1/chat/completions"))
    promised = re.search(r'#.*"content":"([^"]*)"', curl)
    assert promised, "README.md: the curl no longer says its answer"
    return curl, promised.group(1)


def test_the_cpu_profile_answers_the_readmes_chat_request(docker: None) -> None:
    stack = Stack("switchyard-cpu", {})
    try:
        stack.up("--profile", "cpu", "up", "-d", "cpu", wait_for=["cpu"])
        curl, promised = readme_curl()
        out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True,
                             timeout=60)
        assert f'"content":"{promised}"' in out.stdout, out.stdout + out.stderr
        log(f"cpu profile: the README's chat request answered {promised!r}")
        assert httpx.get(f"{URL}/health", timeout=30).status_code == 200
    finally:
        stack.down()


@pytest.fixture(scope="module")
def services(docker: None) -> Iterator[Stack]:
    """The services on the CPU, every expert on both expert services, every span kept."""
    stack = Stack("switchyard-services", {"SWITCHYARD_EXPERT_REPLICAS": "2",
                                          "SWITCHYARD_TRACE_SAMPLE_RATIO": "1"})
    try:
        stack.up("up", "-d", wait_for=["expert-0", "expert-1", "attention-0", "gateway"])
        yield stack
    finally:
        stack.down()


def ask(client: httpx.Client, problem: Problem) -> tuple[int, bool]:
    """One of the demo task's questions: the status, and whether the answer was right."""
    r = client.post(f"{URL}/v1/chat/completions", timeout=120, json={
        "model": "switchyard-arith-moe", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": problem.question}]})
    right = r.status_code == 200 and is_correct(problem,
                                                r.json()["choices"][0]["message"]["content"])
    return r.status_code, right


def query(promql: str) -> list[dict]:
    """A PromQL query over Prometheus' HTTP API: its result vector ([] until it answers)."""
    try:
        r = httpx.get(f"{PROMETHEUS}/api/v1/query", params={"query": promql}, timeout=10)
    except httpx.TransportError:
        return []
    return r.json()["data"]["result"] if r.status_code == 200 else []


def test_prometheus_scrapes_every_service_and_returns_the_per_expert_series(
        services: Stack) -> None:
    """Every service's target is up (the gateway and, directly, each expert and attention
    service), and every expert's routed tokens grow with the requests asked (beyond the
    warm-up's)."""
    up = wait_until(lambda: (r := query("up")) and len(r) == 4 and
                    all(s["value"][1] == "1" for s in r) and r, 60,
                    lambda: f"not every target up: {query('up')}")
    assert isinstance(up, list)
    log("PromQL up: " + ", ".join(sorted(f"{s['metric']['job']} {s['metric']['instance']}"
                                         for s in up)))

    def series() -> list[dict]:
        return query('sum by (expert) (switchyard:expert_tokens_total{job="services"})')

    def total(result: list[dict]) -> float:
        return sum(float(s["value"][1]) for s in result)

    before = total(wait_until(series, 60, lambda: "no per-expert series in Prometheus"))
    with httpx.Client() as client:
        assert [ask(client, p)[0] for p in problems(1, 4)] == [200] * 4
    result = wait_until(lambda: (r := series()) and total(r) > before and r, 60,
                        lambda: "the requests' tokens never reached Prometheus")
    assert isinstance(result, list)
    experts = sorted(int(s["metric"]["expert"]) for s in result)
    assert experts == list(range(8)), result  # the demo model's 8 experts, each routed to
    log('PromQL sum by (expert) (switchyard:expert_tokens_total{job="services"}): ' + ", ".join(
        f"expert {s['metric']['expert']}: {s['value'][1]}" for s in
        sorted(result, key=lambda s: int(s["metric"]["expert"]))))


def test_phoenix_receives_the_services_spans(services: Stack) -> None:
    """Once Phoenix listens (nothing waits for it when the stack starts, and under CI's
    load its start takes tens of seconds), a request's spans reach it from the services."""
    def answers(path: str) -> httpx.Response | None:
        try:
            return httpx.get(f"{PHOENIX}{path}", params={"limit": 1000}, timeout=10)
        except httpx.TransportError:  # not listening yet
            return None

    def spans() -> list[dict]:
        r = answers("/v1/projects/default/spans")
        return r.json()["data"] if r is not None and r.status_code == 200 else []

    wait_until(lambda: (r := answers("/healthz")) is not None and r.status_code == 200, 300,
               lambda: f"Phoenix not up; its log: {services.compose('logs', 'jaeger')[-3000:]}")
    with httpx.Client() as client:
        assert ask(client, problems(2, 1)[0])[0] == 200
    got = wait_until(lambda: [s for s in spans() if s["name"].startswith("chat ")], 120,
                     lambda: f"no request span in Phoenix: {spans()[:3]}")
    assert isinstance(got, list)
    names = {s["name"] for s in spans()}
    log(f"Phoenix: {len(spans())} spans received, named {sorted(names)[:8]}")


@pytest.mark.parametrize("victim", ["expert-1", "attention-0"])
def test_a_container_killed_under_load_fails_no_request(services: Stack, victim: str
                                                        ) -> None:
    """4 clients ask back to back; the victim's process is SIGKILLed from the host (a
    crash: `docker kill` would mark the container stopped by hand, which Docker's restart
    policy leaves down); the load goes on until the policy has it healthy again, and 8
    requests more: every request answered."""
    restarts = services.state(victim)["RestartCount"]
    stop, results = threading.Event(), []  # (status, right) of each request

    def client(seed: int) -> None:
        with httpx.Client() as c:
            for p in itertools.cycle(problems(seed, 50)):  # held out from training
                if stop.is_set():
                    return
                results.append(ask(c, p))

    threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(results) >= 8, 60)
        os.kill(services.state(victim)["State"]["Pid"], signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: services.state(victim)["RestartCount"] > restarts
                   and services.healthy(victim), 300, lambda: f"{victim} not back")
        back = time.monotonic() - killed
        n = len(results)
        wait_until(lambda: len(results) >= n + 8, 60)  # served with it back
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    failed = [status for status, _ in results if status != 200]
    right = sum(r for _, r in results)
    log(f"{victim}'s process SIGKILLed under 4 clients: {len(results) - len(failed)} ok, "
        f"{len(failed)} failed ({right} answers right); restarted by its policy and "
        f"healthy again in {back:.1f} s")
    assert failed == [] and len(results) > 16
