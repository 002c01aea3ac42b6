"""compose.yaml as `switchyard compose` renders it: the committed files are the default
layout, every layout pins each GPU once and places every expert, the Dockerfile installs
as the README does; the launcher's ports and probes (run for real: tests/e2e/test_compose.py)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from ep_dispatch.placement import make_placement
from services.model.config import ModelConfig
from switchyard.compose import (
    CPU_HEADER,
    Layout,
    dump,
    main,
    mounted_paths,
    prometheus_config,
    render,
)
from switchyard.demo_model import DEFAULT_MODEL
from tests.support import ROOT

COMPOSE = ROOT / "compose.yaml"
pytestmark = pytest.mark.timeout(600)




def test_committed_files_are_the_default_layout(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path / "compose.yaml"),
                 "--prometheus", str(tmp_path / "deploy/prometheus.yml")]) == 0
    assert (tmp_path / "compose.yaml").read_text() == COMPOSE.read_text()
    assert (tmp_path / "deploy/prometheus.yml").read_text() == \
        (ROOT / "deploy/prometheus.yml").read_text()


def test_committed_cpu_files_are_the_cpu_layout_on_the_host_network() -> None:
    """deploy/compose.cpu.yaml (what the README runs where no registry image can be had)
    and its Prometheus configuration, as `main` renders them there: their paths relative
    to the file, the demo model's among them."""
    out, scrape = ROOT / "deploy/compose.cpu.yaml", ROOT / "deploy/prometheus.cpu.yml"
    layout = Layout(expert_services=2, dcp_size=1, device="cpu", network="host",
                    **mounted_paths(out, scrape, "cpu"))
    assert dump(render(layout), CPU_HEADER.format(args=layout.args())) == out.read_text()
    assert dump(prometheus_config(layout), "# Rendered by `switchyard compose`.\n") == \
        scrape.read_text()
    text = out.read_text()
    assert "${SWITCHYARD_MODEL_DIR:-../switchyard/models/arith-moe}" in text
    assert (out.parent / "../switchyard/models/arith-moe/config.json").is_file()
    assert "./prometheus.cpu.yml:/etc/prometheus/prometheus.yml:ro" in text


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




def test_the_dockerfile_installs_as_the_readme_does() -> None:
    """On a base of the builder's choice (CUDA's by default), through scripts/bootstrap.sh,
    dependencies before the source (a layer that survives a source change). Built for
    real on a local Debian base: tests/e2e/test_docker.py."""
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=nvidia/cuda:\S+$", text, re.M)
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${BASE_IMAGE}", "${BASE_IMAGE}"]
    runs = re.findall(r"^RUN (.*(?:\\\n.*)*)", text, re.M)
    boot = [i for i, r in enumerate(runs) if 'scripts/bootstrap.sh "$EXTRAS"' in r]
    assert len(boot) == 2
    assert "pip install" not in " ".join(runs).replace("pip install --no-build-isolation .",
                                                      "")
    lines = text.splitlines()
    at = {key: next(i for i, line in enumerate(lines) if line.startswith(key))
          for key in ("COPY pyproject.toml", "RUN scripts/bootstrap.sh", "COPY switchyard",
                      "COPY common")}
    assert at["COPY pyproject.toml"] < at["RUN scripts/bootstrap.sh"] < at["COPY switchyard"]
    packages = re.findall(r'include = \[(.*)\]', (ROOT / "pyproject.toml").read_text())[0]
    for package in re.findall(r'"(\w+)\*"', packages):  # every package is copied in
        assert re.search(rf"^COPY {package} {package}$", text, re.M), package
    assert re.search(r"^USER switchyard$", text, re.M)
    assert "WITH_DEEPEP" in text


def test_the_host_network_layout_puts_every_service_on_its_own_loopback_ports() -> None:
    """`--network host --device cpu`: no published ports, no GPU, every address on
    127.0.0.1, no two services on one port, and each reference points at a listener."""
    doc = render(Layout(8, 3, 2, 2, device="cpu", network="host"))
    services = doc["services"]
    assert all(s["network_mode"] == "host" and "ports" not in s and "deploy" not in s
               for s in services.values())
    listens: list[str] = []
    for name, s in services.items():
        command = s.get("command", [])
        if command[:1] != ["switchyard"] or name == "cpu":
            continue
        assert _flag(command, "--host") in ("127.0.0.1", "${SWITCHYARD_HOST:-0.0.0.0}")
        for flag in ("--port", "--metrics-port"):
            if (port := _flag(command, flag)) is not None:
                listens.append(port)
        if _flag(command, "--dcp-rank") is None and "--dcp-init" in command:
            listens.append(_flag(command, "--dcp-init").split(":")[1])
    assert len(listens) == len(set(listens)), listens
    referenced = [a for s in services.values() for flag in ("--expert-addresses", "--engine")
                  for a in (_flag(s.get("command", []), flag) or "").split(",") if a]
    assert referenced and all(a.startswith("127.0.0.1:") and a.split(":")[1] in listens
                              for a in referenced)
    assert doc["volumes"] == {"cpu-kernels": {}}


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




def test_a_port_another_process_was_handed_is_not_handed_out(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    """Two launchers side by side (test workers) drew the same port now and then: the one
    handed out in another process is skipped, until its reservation lapses."""
    import subprocess
    import sys

    from common import ports

    monkeypatch.setattr(ports, "RESERVATIONS", tmp_path / "ports.json")
    other = subprocess.run([sys.executable, "-c", (
        f"from common import ports; from pathlib import Path\n"
        f"ports.RESERVATIONS = Path({str(tmp_path / 'ports.json')!r})\n"
        f"print(ports.free_port())")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr
    theirs = int(other.stdout)
    draws = iter([theirs, theirs, theirs + 1])
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(draws))
    assert ports.free_port() == theirs + 1  # (the draws: theirs twice, refused; then this)
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: theirs)
    (tmp_path / "ports.json").write_text("[not json")  # torn: read as no reservations
    assert ports.free_port() == theirs
    monkeypatch.setattr(ports, "_HANDED_OUT", set())  # as if another process asked:
    assert ports.free_port() >= ports._ephemeral_low()  # theirs refused, every draw: port 0's
    monkeypatch.setattr(ports, "RESERVED_S", 0.0)  # lapsed: theirs is free again
    assert ports.free_port() == theirs


def test_service_urls_for_any_bound_host() -> None:
    from common.ports import http_url

    assert http_url("127.0.0.1", 80) == "http://127.0.0.1:80"
    assert http_url("0.0.0.0", 80) == "http://127.0.0.1:80"  # a wildcard, reached on loopback
    assert http_url("::", 80) == "http://[::1]:80"
    assert http_url("::1", 80) == "http://[::1]:80"
    assert http_url("fe80::1", 81) == "http://[fe80::1]:81"
    assert httpx.URL(http_url("::", 8000)).port == 8000  # one httpx takes (was InvalidURL)




