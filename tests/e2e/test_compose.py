"""compose.yaml run for real: a compose implementation accepts it, and its services run as
local processes on loopback (`tests/support/compose_runner.py`); serve's and the services'
environment handling."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest
import yaml

from switchyard.demo_model import DEFAULT_MODEL
from tests.support import ROOT
from tests.support.compose_runner import LocalCompose, interpolate
from tests.support.serving import disturbed_streams
from tests.support.tools import missing, wait_until

pytestmark = pytest.mark.timeout(600)

COMPOSE = ROOT / "compose.yaml"




@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_a_compose_implementation_accepts_it(profile: str) -> None:
    """Debian's docker-compose (1.29, the Python implementation) parses, interpolates and
    validates the file against the Compose schema it ships, without a Docker engine."""
    exe = shutil.which("docker-compose")
    if exe is None:
        missing("docker-compose")
    out = subprocess.run([exe, "--project-directory", str(ROOT), "-f", str(COMPOSE),
                          "--profile", profile, "config"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    assert {"gateway", "expert-0", "attention-0", "jaeger", "prometheus"} <= set(services)
    assert services["gateway"]["depends_on"]["attention-0"]["condition"] == "service_healthy"


def ask(url: str) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "model": "our-moe", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is 123 + 456?"}]})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_the_compose_services_run_as_local_processes(profile: str) -> None:
    """Also, with each expert on two expert services, one that dies is routed around
    until its restart (compose's `restart: on-failure`) is probed back in."""
    env = {**dotenv(), "SWITCHYARD_MODEL_DIR": str(DEFAULT_MODEL),
           "SWITCHYARD_SERVED_MODEL_NAME": "our-moe",  # what clients send, in both profiles
           "SWITCHYARD_KV_CACHE_MEMORY": "64MiB", "SWITCHYARD_MAX_NUM_SEQS": "16",
           "SWITCHYARD_DEVICE": "cpu",  # no GPU here: the same commands on the CPU
           "SWITCHYARD_EXPERT_REPLICAS": "2"}
    doc = interpolate(yaml.safe_load(COMPOSE.read_text()), env)
    with LocalCompose(doc, {profile}) as compose:
        assert len(compose.services) == (9 if profile == "gpu" else 1)
        compose.up()
        front = "gateway" if profile == "gpu" else "cpu"
        url = f"http://127.0.0.1:{compose.local_port(front, 8000)}"
        assert ask(url) == "579"
        if profile == "cpu":
            return
        ups = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
               if line.startswith("switchyard:service_up")]
        assert len(ups) == 8 and all(line.endswith(" 1.0") for line in ups)  # every service

        def health() -> str:
            r = httpx.get(f"{url}/health", timeout=30)
            assert r.status_code == 200, r.text  # serving all along
            return r.text

        compose.procs["expert-3"].kill()
        compose.procs["expert-3"].wait()
        assert ask(url) == "579"  # its experts' tokens went to their replicas
        assert "expert rank 3 at" in health() and "routed to replicas" in health()
        compose.start("expert-3")  # as its restart policy would
        wait_until(lambda: compose.healthy("expert-3"), 120, lambda: "expert-3 healthy")
        wait_until(lambda: ask(url) == "579" and "routed to replicas" not in health(), 60,
                   lambda: f"expert rank 3 back in the routing: {health()}")


def test_an_attention_group_stopped_for_an_upgrade_loses_no_request() -> None:
    """docs/deploy.md's rolling upgrade: of two attention groups (`switchyard compose
    --attention-groups 2 --device cpu`, its services run as local processes), one is
    stopped as `docker compose stop` stops it (SIGTERM: it exits cleanly) while greedy
    streams run on both. The gateway resubmits that group's streams to the other, and
    every stream ends whole, with the tokens of the same requests undisturbed."""
    out = subprocess.run([sys.executable, "-m", "switchyard", "compose", "--device", "cpu",
                          "--attention-groups", "2", "--dcp-size", "1", "--expert-services",
                          "2"], capture_output=True, text=True, timeout=120, check=True)
    env = {"SWITCHYARD_MODEL_DIR": str(DEFAULT_MODEL), "SWITCHYARD_SERVED_MODEL_NAME": "our-moe",
           "SWITCHYARD_KV_CACHE_MEMORY": "64MiB", "SWITCHYARD_MAX_NUM_SEQS": "16",
           "SWITCHYARD_ROUTING_POLICY": "least-busy"}  # the streams on both groups
    doc = interpolate(yaml.safe_load(out.stdout), env)
    with LocalCompose(doc, set()) as compose:
        assert sorted(compose.services) == ["attention-0", "attention-1", "expert-0",
                                            "expert-1", "gateway"]
        compose.up()
        url = f"http://127.0.0.1:{compose.local_port('gateway', 8000)}"
        ps = [[1 + (7 * i + j) % 50 for j in range(9 + 4 * i)] for i in range(6)]
        def logs() -> str:
            return "\n".join(f"--- {n}:\n{compose.log(n)[-4000:]}"
                             for n in ("gateway", "attention-0", "attention-1"))

        undisturbed = greedy_streams(url, ps, None, logs)
        moved = greedy_streams(url, ps, compose.procs["attention-1"], logs)
        assert [o["tokens"] for o in moved] == [o["tokens"] for o in undisturbed]
        assert "resubmitting" in compose.log("gateway")


def greedy_streams(url: str, ps: list[list[int]], stop: subprocess.Popen | None,
                   logs: Callable[[], str]) -> list[dict]:
    """Stream 32 greedy tokens of each prompt at once; SIGTERM `stop` once every stream
    has its first tokens, and wait for it to exit cleanly. A failure shows `logs()`."""
    def stopped() -> None:
        assert stop is not None
        stop.terminate()
        assert stop.wait(60) == 0

    body = {"max_tokens": 32, "ignore_eos": True, "temperature": 0}
    outs = disturbed_streams(url, "our-moe", ps, body, None if stop is None else stopped)
    for out in outs:
        assert out["status"] == 200 and out["finish"] == "length", f"{out}\n{logs()}"
        assert out["usage"]["completion_tokens"] == 32 == len(out["tokens"])
    return outs


def test_serve_decides_its_childrens_topology_whatever_the_environment() -> None:
    """SWITCHYARD_* variables for what `serve` decides per child (backend, DCP size, ranks,
    ports) do not reach the children: `serve --dispatch-backend rpc --dcp-size 1` with
    the environment saying torch and 2 still starts and answers (before, the experts read
    torch, the attention service DCP size 2, and start-up failed)."""
    from switchyard.demo_model import DEFAULT_MODEL
    from switchyard.serve_process import Served

    env = {"SWITCHYARD_DISPATCH_BACKEND": "torch", "SWITCHYARD_DCP_SIZE": "2",
           "SWITCHYARD_EXPERT_RANKS": "7", "SWITCHYARD_ATTENTION_RANK": "3"}
    with Served(["--model", str(DEFAULT_MODEL), "--dispatch-backend", "rpc", "--dcp-size",
                 "1"], env=env, timeout=120) as served:
        r = httpx.post(f"{served.url}/v1/completions", timeout=60, json={
            "prompt": "1+1=", "max_tokens": 2})
        assert r.status_code == 200, r.text




def test_a_child_that_dies_is_named_at_once_whichever_it_is() -> None:
    """An attention rank waiting in its rendezvous for an expert rank that exits at once:
    start-up names the expert within seconds (before, it waited on the attention rank
    first, until the rendezvous gave up after 120 s)."""
    from common.ports import free_port
    from switchyard.children import Children, StartupError
    from switchyard.demo_model import DEFAULT_MODEL

    children = Children()
    waiting = ["attention", "--model", str(DEFAULT_MODEL), "--port", "0", "--dispatch-backend",
               "torch", "--dist-init", f"127.0.0.1:{free_port()}", "--attention-ranks", "1",
               "--expert-ranks", "1"]
    try:  # (waiting in turn would fail otherwise: "... did not start listening in time")
        with pytest.raises(StartupError, match=r"expert rank 0 exited with status 2 before "
                                               r"listening"):
            children.start_all([("attention rank 0", waiting), (
                "expert rank 0", ["expert", "--model", "/no/such/checkpoint"])], timeout=100)
    finally:
        children.stop()


def dotenv() -> dict[str, str]:
    lines = (ROOT / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
