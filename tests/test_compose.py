"""compose.yaml: what `switchyard compose` renders, valid Compose by a real implementation's
parser, and runnable: its Switchyard services, started as local processes with their own
commands, environments and healthchecks, answer a chat completion correctly."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from ep_dispatch.placement import make_placement
from services.model.config import ModelConfig
from switchyard.compose import Layout, main, render
from switchyard.demo_model import DEFAULT_MODEL
from tests.compose_runner import LocalCompose, interpolate
from tests.tools import missing, wait_until

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose.yaml"
pytestmark = pytest.mark.timeout(600)


def dotenv() -> dict[str, str]:
    lines = (ROOT / ".env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_committed_files_are_the_default_layout(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path / "compose.yaml"),
                 "--prometheus", str(tmp_path / "prometheus.yml")]) == 0
    assert (tmp_path / "compose.yaml").read_text() == COMPOSE.read_text()
    assert (tmp_path / "prometheus.yml").read_text() == \
        (ROOT / "deploy/prometheus.yml").read_text()


def _commands(services: dict, kind: str) -> list[list[str]]:
    """The commands of the `switchyard KIND` services."""
    return [s["command"] for s in services.values() if s.get("command", [])[1:2] == [kind]]


def _flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


@pytest.mark.parametrize("layout", [Layout(), Layout(4, 2, 1, 2), Layout(16, 12, 2, 2),
                                    Layout(3, 1, 2, 1), Layout(8, 3, 1, 1)],
                         ids=lambda x: x.args().replace(" ", ""))
def test_layouts_pin_each_gpu_once_and_place_every_expert(layout: Layout) -> None:
    services = render(layout)["services"]
    gpus = [d["device_ids"] for s in services.values()
            for d in s.get("deploy", {}).get("resources", {}).get("reservations", {})
            .get("devices", [])]
    flat = [int(g) for ids in gpus for g in ids]
    assert all(len(ids) == 1 for ids in gpus)
    assert len(flat) == len(set(flat)) == layout.attention_groups * layout.dcp_size + \
        layout.expert_services
    assert all(0 <= g < layout.gpus for g in flat)
    # a rank that exits (a crash, or a lockstep world out of step) is started again
    ours = [s for s in services.values() if "SWITCHYARD_IMAGE" in s.get("image", "")]
    assert ours and all(s["restart"] == "on-failure" for s in ours)

    experts = _commands(services, "expert")
    ranks = sorted(int(_flag(c, "--rank")) for c in experts)
    assert ranks == list(range(layout.expert_services))
    assert {_flag(c, "--num-ranks") for c in experts} == {str(layout.expert_services)}
    cfg = ModelConfig.from_dir(DEFAULT_MODEL)
    moe = cfg.moe_layer_ids
    placement = make_placement(moe, cfg.num_experts, layout.expert_services)
    held = {(layer, e) for r in ranks for layer, ids in placement.local_experts(r).items()
            for e in ids}
    assert held == {(layer, e) for layer in moe for e in range(cfg.num_experts)}

    attention = _commands(services, "attention")
    assert len(attention) == layout.attention_groups * layout.dcp_size
    addresses = {_flag(c, "--expert-addresses") for c in attention}
    assert len(addresses) == 1 and len(addresses.pop().split(",")) == layout.expert_services
    engines = _flag(services["gateway"]["command"], "--engine").split(",")
    assert len(engines) == layout.attention_groups
    for name, s in services.items():
        for dep in s.get("depends_on", {}):
            assert dep in services and dep != name


def test_too_few_gpus_is_an_error() -> None:
    with pytest.raises(ValueError, match="need 9 GPUs; --gpus is 8"):
        render(Layout(8, 7, 2, 1))
    assert main(["--gpus", "2", "--expert-services", "2"]) == 2


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


def test_the_dockerfile_installs_as_the_readme_does() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert len(stages) == 2 and all(s.startswith("nvidia/cuda:") for s in stages)
    runs = " ".join(re.findall(r"^RUN (.*(?:\\\n.*)*)", text, re.M))
    assert "scripts/bootstrap.sh gpu" in runs
    assert "pip install" not in runs.replace("pip install --no-build-isolation .", "")
    assert re.search(r"^USER switchyard$", text, re.M)
    assert "WITH_DEEPEP" in text


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


def test_probe_reports_what_is_wrong() -> None:
    from common.ports import free_port
    from switchyard.probe import main as probe

    port = free_port()  # nothing listens there
    assert probe([f"127.0.0.1:{port}", "--timeout", "2"]) == 1
    assert probe([f"http://127.0.0.1:{port}/health", "--timeout", "2"]) == 1
    assert probe(["not-an-address", "--timeout", "2"]) == 1


def test_free_ports_come_from_below_the_ephemeral_range() -> None:
    """What `free_port` hands out (rendezvous addresses, the compose runner's ports) is
    never what a service binding port 0 meanwhile gets: that draws from the ephemeral range
    (a collision there made the compose test's gateway find its port taken)."""
    import socket

    from common.ports import _ephemeral_low, free_port

    low = _ephemeral_low()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20  # none handed out twice before anyone binds it
    for port in ports:
        assert 1024 <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # still free


def test_free_port_without_room_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A kernel whose ephemeral range starts at 1024 leaves nothing below: any free port."""
    from common import ports

    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 1024)
    assert ports.free_port() >= 1024


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


def test_service_urls_for_any_bound_host() -> None:
    from common.ports import http_url

    assert http_url("127.0.0.1", 80) == "http://127.0.0.1:80"
    assert http_url("0.0.0.0", 80) == "http://127.0.0.1:80"  # a wildcard, reached on loopback
    assert http_url("::", 80) == "http://[::1]:80"
    assert http_url("::1", 80) == "http://[::1]:80"
    assert http_url("fe80::1", 81) == "http://[fe80::1]:81"
    assert httpx.URL(http_url("::", 8000)).port == 8000  # one httpx takes (was InvalidURL)


def test_attention_and_expert_services_take_their_model_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SWITCHYARD_MODEL, as the gateway and `serve` take it (they required --model)."""
    import argparse

    from services.expert.config import add_expert_parser
    from switchyard.cli import _attention_parser

    def parse(argv: list[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="command", required=True)
        _attention_parser(sub)
        add_expert_parser(sub)
        return parser.parse_args(argv)

    monkeypatch.setenv("SWITCHYARD_MODEL", "/models/from-env")
    assert parse(["attention"]).model == parse(["expert"]).model == "/models/from-env"
    assert parse(["expert", "--model", "/flag"]).model == "/flag"  # the flag wins
    monkeypatch.delenv("SWITCHYARD_MODEL")
    with pytest.raises(SystemExit):
        parse(["attention"])  # neither: --model is required


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
