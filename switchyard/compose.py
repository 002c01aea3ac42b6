"""`switchyard compose`: the docker compose deployment of one GPU host, for a layout.

    switchyard compose --gpus 8 --expert-services 6 --dcp-size 2 > compose.yaml

renders the gateway, G attention groups of D DCP ranks each, E expert services, Jaeger
(OTLP in, UI on 16686) and Prometheus, which scrapes every service's /metrics. Each GPU
service is pinned to its own GPU, with healthchecks and start-up order. A `cpu` profile
serves the bundled demo model in one container with no GPU. `--prometheus` writes the
scrape configuration the layout needs. The committed `compose.yaml` and
`deploy/prometheus.yml` are this command's output for the default layout.

`--device cpu` renders the same services with no GPU: no reservations, started by a plain
`docker compose up`, sharing one volume for the CPU kernels they build. `--network host`
puts every service on the host's network (compose's `network_mode: host`). Each listens on
127.0.0.1 on ports of its own, and finds the others there rather than by name; the gateway
listens on `${SWITCHYARD_HOST:-0.0.0.0}`. Prometheus scrapes them there. The CPU demo, on
the gateway's port, has no job of its own.

Healthchecks are `switchyard probe`'s: HTTP 200, or an `InfoRequest` answered over the
service's own protocol. The start order is `depends_on: service_healthy`: the experts, then
a DCP group's ranks together, then the gateway. GPU services share `ipc: host` and
NCCL's ulimits. The compose file only names by host and fixed port the services `switchyard
serve` starts as local processes: `tests/e2e/test_compose.py` runs the file's Switchyard
services as local processes to prove it (docs/deploy.md), and `tests/e2e/test_docker.py`
runs a `--device cpu --network host` stack, and the `cpu` profile, under a real Docker
engine, on images `scripts/docker-prepare` builds on a local Debian base, with no registry
image. Each container's restart policy, and the out-of-step exit (status 3), bring a
collective backend's world up again one container at a time.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from switchyard.demo_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from switchyard.topology import (
    ENGINE_SETTINGS,
    GATEWAY_SETTINGS,
    METRICS,
    RENDEZVOUS,
    SERVE,
    Place,
    Ref,
    ServiceSet,
    Topology,
    build,
)

GATEWAY_PORT = 8000
ATTENTION_PORT = 7000
EXPERT_PORT = 7100
METRICS_PORT = 9400
DCP_INIT_PORT = 29500
OTLP = "http://jaeger:4318"
# Third-party images, pinned; `switchyard` services use the image built from ./Dockerfile.
JAEGER_IMAGE = "jaegertracing/jaeger:2.21.0"
PROMETHEUS_IMAGE = "prom/prometheus:v3.5.0"
HEADER = """\
# Switchyard on one GPU host: rendered by `switchyard compose {args}`
# (tests/switchyard/test_compose.py keeps the committed file equal to that). Settings: .env.
#   openssl rand -hex 32 > cluster-secret && chmod 444 cluster-secret   # once: the secret
#                                      # the services prove to each other (docs/deploy.md)
#   docker compose up                  # the GPU services (COMPOSE_PROFILES=gpu in .env)
#   docker compose --profile cpu up    # the bundled demo model on the CPU, no GPU
# Chat: http://HOST:8000/v1   Jaeger: http://HOST:16686   Prometheus: http://HOST:9090
"""
CPU_HEADER = """\
# Switchyard on one host's CPU: rendered by `switchyard compose {args}`
# (tests/switchyard/test_compose.py keeps the committed deploy/compose.cpu.yaml equal to
# that). The demo model by default; SWITCHYARD_MODEL_DIR and the other settings of ../.env
# from the shell. Where Docker Hub cannot be reached, scripts/docker-prepare (root) makes
# the engine and the images, and deploy/compose.local.yaml replaces Jaeger and Prometheus:
#   docker-compose -f deploy/compose.cpu.yaml -f deploy/compose.local.yaml up -d
#   (or the demo in one container: ... --profile cpu up -d cpu jaeger prometheus)
# Chat: http://127.0.0.1:8000/v1   traces: http://127.0.0.1:16686 (Jaeger) or :4318
# (Phoenix)   Prometheus: http://127.0.0.1:9090
"""


@dataclass(frozen=True)
class Layout:
    """Which GPU runs what, and where the services find each other. Attention group g's
    DCP rank r runs on GPU g * D + r, then come the expert services, one GPU each."""

    gpus: int = 8
    expert_services: int = 6
    dcp_size: int = 2
    attention_groups: int = 1
    device: str = "cuda"  # cpu: the same services, no GPU
    network: str = "bridge"  # host: the host's network, services on loopback ports
    # the host paths the file mounts, relative to it (compose's project directory)
    model_dir: str = "./model"  # SWITCHYARD_MODEL_DIR's default
    prometheus_file: str = "./deploy/prometheus.yml"

    def check(self) -> None:
        if min(self.gpus, self.expert_services, self.dcp_size, self.attention_groups) < 1:
            raise ValueError("--gpus, --expert-services, --dcp-size and --attention-groups "
                             "must be at least 1")
        if self.device not in ("cuda", "cpu") or self.network not in ("bridge", "host"):
            raise ValueError("--device is cuda or cpu; --network is bridge or host")
        need = self.attention_groups * self.dcp_size + self.expert_services
        if self.gpu and need > self.gpus:
            raise ValueError(f"{self.attention_groups} attention group(s) of {self.dcp_size} "
                             f"DCP rank(s) and {self.expert_services} expert services need "
                             f"{need} GPUs; --gpus is {self.gpus}")

    def gpu_of(self, set: str, group: int, rank: int) -> int:
        """Attention group g's DCP rank r on GPU g * D + r, then the expert services."""
        if set == "expert":
            return self.attention_groups * self.dcp_size + group
        return group * self.dcp_size + rank

    def topology(self) -> Topology:
        return build(self.expert_services, self.dcp_size, self.attention_groups, self.device,
                     "switchyard" if self.gpu else DEFAULT_MODEL_NAME)

    def args(self) -> str:
        out = f"--gpus {self.gpus} " if self.gpu else f"--device {self.device} "
        out += (f"--expert-services {self.expert_services} --dcp-size {self.dcp_size} "
                f"--attention-groups {self.attention_groups}")
        return out + ("" if self.network == "bridge" else f" --network {self.network}")

    def image(self) -> str:
        """The Switchyard image: `docker build -t switchyard:latest .` on GPU hosts,
        scripts/docker-prepare's CPU image otherwise."""
        return "${SWITCHYARD_IMAGE:-switchyard:%s}" % ("latest" if self.gpu else "cpu")

    def served_model_name(self) -> str:
        """What clients send; on the CPU, by default, the demo model's name."""
        return "${SWITCHYARD_SERVED_MODEL_NAME:-%s}" % (
            "switchyard" if self.gpu else DEFAULT_MODEL_NAME)

    def model_volume(self) -> str:
        return f"${{SWITCHYARD_MODEL_DIR:-{self.model_dir}}}:/model:ro"

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def host(self) -> bool:
        """On the host's network: every service on 127.0.0.1, each on a port of its own."""
        return self.network == "host"

    def bind(self) -> str:
        return "127.0.0.1" if self.host else "0.0.0.0"

    def address(self, service: str, port: int) -> str:
        return f"127.0.0.1:{port}" if self.host else f"{service}:{port}"

    def expert_port(self, rank: int) -> int:
        return EXPERT_PORT + rank * self.host

    def attention_port(self, group: int) -> int:
        return ATTENTION_PORT + group * self.host

    def dcp_init_port(self, group: int) -> int:
        return DCP_INIT_PORT + group * self.host

    def expert_metrics_port(self, rank: int) -> int:
        return METRICS_PORT + rank * self.host

    def attention_metrics_port(self, group: int, rank: int) -> int:
        offset = self.expert_services + group * self.dcp_size + rank
        return METRICS_PORT + offset * self.host

    def otlp(self) -> str:
        return "http://127.0.0.1:4318" if self.host else OTLP


def _attention_name(group: int, rank: int) -> str:
    return f"attention-{group}" if rank == 0 else f"attention-{group}-dcp{rank}"


SECRET = "cluster-secret"  # the compose secret every service's connections prove
SECRET_FILE = f"${{SWITCHYARD_CLUSTER_SECRET:-./{SECRET}}}"  # its file on the host


def _secret(layout: Layout) -> dict:
    """Services that listen beyond loopback prove the cluster secret on every connection
    (`common.auth`). Compose mounts it at /run/secrets/, never on a command line. On the
    host's network every service listens on loopback, where none is needed."""
    return {} if layout.host else {"secrets": [SECRET]}


def _common_env(service: str, layout: Layout) -> dict[str, str]:
    secret = {} if layout.host else \
        {"SWITCHYARD_CLUSTER_SECRET_FILE": f"/run/secrets/{SECRET}"}
    return {
        **secret,
        "OTEL_EXPORTER_OTLP_ENDPOINT": layout.otlp(),
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "${SWITCHYARD_TRACE_SAMPLE_RATIO:-0.01}",
        "OTEL_RESOURCE_ATTRIBUTES": f"service.instance.id={service}",
    }


KERNELS_VOLUME = "cpu-kernels"  # --device cpu: the CPU kernels, built once for all services
KERNELS_PATH = "/home/switchyard/.cache/torch_extensions"  # torch's extension cache


def _service(layout: Layout, name: str, gpu: int, command: list[str], health: str,
             depends: list[str]) -> dict:
    """An expert or attention service; on its GPU with `--device cuda`."""
    service: dict = {
        "image": layout.image(),
        **({"profiles": ["gpu"]} if layout.gpu else {}),
        "command": command,
        "environment": _common_env(name, layout),
        **_secret(layout),
        "volumes": [layout.model_volume()],
    }
    if layout.gpu:
        service.update({
            "ipc": "host",  # NCCL and CUDA IPC between the GPU services
            "ulimits": {"memlock": -1, "stack": 67108864},
            "deploy": {"resources": {"reservations": {"devices": [{
                "driver": "nvidia", "device_ids": [str(gpu)], "capabilities": ["gpu"]}]}}}})
    else:
        service["volumes"].append(f"{KERNELS_VOLUME}:{KERNELS_PATH}")
    service.update(_network(layout))
    service.update({
        "healthcheck": _health(health),
        # After a crash, or a rank that left a lockstep world out of step (status 3), the
        # service comes back up, its peers too, and the world forms again.
        "restart": "on-failure",
    })
    if depends:
        service["depends_on"] = {d: {"condition": "service_healthy"} for d in depends}
    return service


def _network(layout: Layout) -> dict:
    return {"network_mode": "host"} if layout.host else {}


def render(layout: Layout) -> dict:
    """The compose document for `layout`."""
    layout.check()
    topology = layout.topology()
    services = {}
    for s in (topology.expert, topology.attention):
        for g, r in s.members():
            place = ComposePlace(layout, topology, s, g, r)
            name = place.name()
            services[name] = _service(layout, name, layout.gpu_of(s.name, g, r),
                                      place.command(), place.health(),
                                      [n for a in s.after for n in place.names(a)])
            services[name]["environment"].update(_settings(s.settings))
    gateway = ComposePlace(layout, topology, topology.gateway, 0, 0)
    services["gateway"] = _gateway(layout, gateway, gateway.names("attention", leaders=True))
    services.update(_companions(layout))
    doc: dict = {"services": services}
    if not layout.host:
        doc["secrets"] = {SECRET: {"file": SECRET_FILE}}
    if not layout.gpu:
        doc["volumes"] = {KERNELS_VOLUME: {}}
    return doc


class ComposePlace(Place):
    """Compose's spelling. Services are found by name on their base ports, or on the host's
    network all on 127.0.0.1, each on ports of its own. Settings are spelt
    `${SWITCHYARD_X:-default}`."""

    def __init__(self, layout: Layout, topology: Topology, set: ServiceSet, replica: int,
                 member: int) -> None:
        super().__init__(topology, set, replica, member, "/model")
        self.layout = layout

    def name(self, set: str | None = None, replica: int | None = None,
             member: int | None = None) -> str:
        set = set or self.set.name
        g = self.replica if replica is None else replica
        r = self.member if member is None else member
        return {"expert": f"expert-{g}", "gateway": "gateway"}.get(set) or \
            _attention_name(g, r)

    def names(self, set: str, leaders: bool = False) -> list[str]:
        """Every service of a set; with `leaders`, each unit's member 0 only."""
        return [self.name(set, g, r) for g, r in self.topology.sets[set].members()
                if r == 0 or not leaders]

    def port(self, name: str) -> str:
        return str(self.port_of(self.set.name, self.replica, self.member, name))

    def port_of(self, set: str, g: int, r: int, name: str) -> int | str:
        layout = self.layout
        if set == "gateway":
            return _front_port(layout)
        if name == METRICS:
            return layout.expert_metrics_port(g) if set == "expert" \
                else layout.attention_metrics_port(g, r)
        if name == RENDEZVOUS:
            return layout.dcp_init_port(g)
        return layout.expert_port(g) if set == "expert" else layout.attention_port(g)

    def address(self, ref: Ref) -> str:
        port = self.port_of(ref.set, ref.replica, ref.member, ref.port)
        return self.layout.address(self.name(ref.set, ref.replica, ref.member), int(port))

    def setting(self, name: str, default: str) -> str:
        return f"${{SWITCHYARD_{name}:-{default}}}"

    def bind(self, front: bool) -> str:
        if front:
            return "${SWITCHYARD_HOST:-0.0.0.0}" if self.layout.host else "0.0.0.0"
        return self.layout.bind()

    def health(self) -> str:
        """What its healthcheck probes: the port it serves, or a DCP rank's /metrics,
        which is served once the rank has joined its group."""
        if self.member == 0:
            return f"127.0.0.1:{self.port(SERVE)}"
        return f"http://127.0.0.1:{self.port(METRICS)}/metrics"


def _gateway(layout: Layout, place: ComposePlace, leaders: list[str]) -> dict:
    return {
        "image": layout.image(),
        **({"profiles": ["gpu"]} if layout.gpu else {}),
        "command": place.command(),
        "environment": {**_common_env("gateway", layout), **_settings(GATEWAY_SETTINGS)},
        **_secret(layout),
        "volumes": [layout.model_volume()],
        **_published(layout, f"${{SWITCHYARD_PORT:-{GATEWAY_PORT}}}:{GATEWAY_PORT}"),
        "depends_on": {g: {"condition": "service_healthy"} for g in leaders},
        "healthcheck": _health(f"http://127.0.0.1:{_front_port(layout)}/health"),
        "restart": "on-failure",
    }


def _front(layout: Layout) -> list[str]:
    """Where a front door, the gateway or the CPU demo, listens."""
    if layout.host:
        return ["--host", "${SWITCHYARD_HOST:-0.0.0.0}", "--port", _front_port(layout)]
    return ["--host", "0.0.0.0", "--port", str(GATEWAY_PORT)]


def _front_port(layout: Layout) -> str:
    return f"${{SWITCHYARD_PORT:-{GATEWAY_PORT}}}" if layout.host else str(GATEWAY_PORT)


def _published(layout: Layout, *ports: str) -> dict:
    """`ports`, or none on the host's network, where the service is there already."""
    return {"network_mode": "host"} if layout.host else {"ports": list(ports)}


def _settings(names: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The environment entries passing those settings on."""
    return {f"SWITCHYARD_{name}": f"${{SWITCHYARD_{name}:-{default}}}"
            for name, default in names}


def _companions(layout: Layout) -> dict[str, dict]:
    """The CPU demo (profile `cpu`), Jaeger and Prometheus."""
    otlp = "127.0.0.1:4318" if layout.host else "0.0.0.0:4318"
    grpc = "127.0.0.1:4317" if layout.host else "0.0.0.0:4317"
    return {
        "cpu": {
            "image": layout.image(),
            "profiles": ["cpu"],
            "command": ["switchyard", "serve", *_front(layout), "--otlp-traces-endpoint",
                        f"{layout.otlp()}/v1/traces",
                        "--served-model-name", layout.served_model_name()],
            "environment": {
                "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": "${SWITCHYARD_TRACE_SAMPLE_RATIO:-0.01}",
                **_settings(GATEWAY_SETTINGS + ENGINE_SETTINGS)},
            **_published(layout, f"${{SWITCHYARD_PORT:-{GATEWAY_PORT}}}:{GATEWAY_PORT}"),
            "healthcheck": _health(f"http://127.0.0.1:{_front_port(layout)}/health"),
            "restart": "on-failure",
        },
        "jaeger": {
            "image": JAEGER_IMAGE,
            "command": ["--set", f"receivers.otlp.protocols.http.endpoint={otlp}",
                        "--set", f"receivers.otlp.protocols.grpc.endpoint={grpc}"],
            **_published(layout, "${SWITCHYARD_JAEGER_PORT:-16686}:16686"),
        },
        "prometheus": {
            "image": PROMETHEUS_IMAGE,
            "volumes": [f"{layout.prometheus_file}:/etc/prometheus/prometheus.yml:ro"],
            **_published(layout, "${SWITCHYARD_PROMETHEUS_PORT:-9090}:9090"),
        },
    }


def _health(target: str) -> dict:
    """`switchyard probe` answers within its own 3 s, inside the check's 5 s."""
    return {"test": ["CMD", "switchyard", "probe", "--timeout", "3", target],
            "interval": "5s", "timeout": "5s", "retries": 3, "start_period": "600s"}


def prometheus_config(layout: Layout) -> dict:
    """Prometheus' scrape configuration: every service directly, and the gateway's own
    series. The gateway's copy of the services' series is dropped, as it would count
    twice. The CPU demo's services are inside its one container, so its gateway is scraped
    whole. On the host's network the CPU demo listens where the gateway does, so it has no
    job of its own; there its per-expert series are only on its /metrics and dashboard."""
    topology = layout.topology()
    gateway = ComposePlace(layout, topology, topology.gateway, 0, 0)
    targets = [gateway.address(Ref(s.name, g, r, METRICS))
               for s in (topology.expert, topology.attention) for g, r in s.members()]
    merged = {"source_labels": ["__name__"], "action": "drop",
              "regex": "switchyard:(expert|dispatch|combine)_.*"}
    jobs = [{"job_name": "gateway", "metric_relabel_configs": [merged],
             "static_configs": [{"targets": [layout.address("gateway", GATEWAY_PORT)]}]},
            {"job_name": "services", "static_configs": [{"targets": targets}]}]
    if not layout.host:
        jobs.append({"job_name": "cpu",
                     "static_configs": [{"targets": [f"cpu:{GATEWAY_PORT}"]}]})
    return {"global": {"scrape_interval": "5s"}, "scrape_configs": jobs}


class _Dumper(yaml.SafeDumper):
    """Lists of plain values on one line (`command: [switchyard, expert, ...]`)."""

    def represent_list(self, data: list) -> yaml.Node:
        flat = all(isinstance(x, str | int | float) for x in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Dumper.add_representer(list, _Dumper.represent_list)


def dump(doc: dict, header: str = "") -> str:
    return header + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100)


def mounted_paths(out: Path | None, prometheus: Path | None, device: str
                  ) -> dict[str, str]:
    """The mounted host paths, relative to the compose file's folder, which is compose's
    project directory. They are the Prometheus configuration written beside it and, on
    the CPU, the bundled demo model as the default model."""
    base = (out or Path("compose.yaml")).resolve().parent

    def relative(path: Path) -> str:
        rel = os.path.relpath(path.resolve(), base)
        return rel if rel.startswith(".") else f"./{rel}"

    paths = {}
    if prometheus is not None:
        paths["prometheus_file"] = relative(prometheus)
    if device == "cpu":
        paths["model_dir"] = relative(DEFAULT_MODEL)
    return paths


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="switchyard compose", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--expert-services", type=int, default=6)
    ap.add_argument("--dcp-size", type=int, default=2)
    ap.add_argument("--attention-groups", type=int, default=1)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the same services with no GPU (default: cuda)")
    ap.add_argument("--network", choices=["bridge", "host"], default="bridge",
                    help="host: every service on the host's network, on loopback ports")
    ap.add_argument("--out", type=Path, help="write the compose file here (default: stdout)")
    ap.add_argument("--prometheus", type=Path,
                    help="also write the Prometheus scrape configuration here")
    args = ap.parse_args(argv)
    layout = Layout(args.gpus, args.expert_services, args.dcp_size, args.attention_groups,
                    args.device, args.network,
                    **mounted_paths(args.out, args.prometheus, args.device))
    try:
        header = HEADER if layout.gpu else CPU_HEADER
        text = dump(render(layout), header.format(args=layout.args()))
    except ValueError as exc:
        print(f"switchyard compose: {exc}", file=sys.stderr)
        return 2
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    if args.prometheus:
        args.prometheus.parent.mkdir(parents=True, exist_ok=True)
        args.prometheus.write_text(dump(prometheus_config(layout),
                                        "# Rendered by `switchyard compose`.\n"))
    return 0
