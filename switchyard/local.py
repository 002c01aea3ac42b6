"""`switchyard serve`'s rendering of the deployment (`switchyard.topology`).

Each service is a local process on 127.0.0.1, with the gateway on `--host`. Ports are
chosen once at start, so that a child started again listens where it did. The settings,
and every flag the services take beyond the topology's own, are `serve`'s flags, passed on.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from common.flags import as_flags
from common.ports import free_port
from ep_dispatch.deepep_config import deepep_flags, deepep_settings
from ep_dispatch.registry import backend
from gateway.config import serve_flags
from services.attention.config import add_engine_flags
from switchyard.topology import WORLD, Place, Ref, ServiceSet, Topology, build

LOOPBACK = "127.0.0.1"
# Engine flags the topology writes itself (from the settings below, or its layout).
TOPOLOGY_FLAGS = {"dist_init", "dcp_size", "dispatch_backend", "device", "dtype",
                  "kv_cache_memory", "max_num_seqs", "expert_replicas"}

Spec = tuple[str, list[str]]  # a child's name and `python -m switchyard` arguments


@dataclass
class Ports:
    """Every member's ports, each chosen (free) the first time it is asked for."""
    gateway: int
    dist_init: str  # a collective world's rendezvous, HOST:PORT
    chosen: dict[tuple[str, int, int, str], int] = field(default_factory=dict)

    def of(self, set: str, replica: int, member: int, name: str) -> int:
        if set == "gateway":
            return self.gateway
        key = (set, replica, member, name)
        if key not in self.chosen:
            self.chosen[key] = free_port()
        return self.chosen[key]


class LocalPlace(Place):
    def __init__(self, topology: Topology, set: ServiceSet, replica: int, member: int,
                 model: str, ports: Ports, settings: dict[str, str], host: str) -> None:
        super().__init__(topology, set, replica, member, model)
        self.ports, self.settings, self.host = ports, settings, host

    def port(self, name: str) -> str:
        return str(self.ports.of(self.set.name, self.replica, self.member, name))

    def address(self, ref: Ref) -> str:
        return f"{LOOPBACK}:{self.ports.of(ref.set, ref.replica, ref.member, ref.port)}"

    def leader(self, port: str) -> str:
        if port == WORLD:
            return self.ports.dist_init
        return self.address(Ref(self.set.name, self.replica, 0, port))

    def setting(self, name: str, default: str) -> str:
        return self.settings.get(name, default)

    def bind(self, front: bool) -> str:
        return self.host if front else LOOPBACK


def child_name(set: str, replica: int, member: int) -> str:
    """The name `serve` gives a child (its logs, its restart units, the tests')."""
    if set == "expert":
        return f"expert rank {replica}"
    if set == "gateway":
        return "gateway"
    return f"attention group {replica}" + (f" DCP rank {member}" if member else "")


@dataclass(frozen=True)
class LocalServices:
    experts: list[Spec]
    attention: list[Spec]  # each group's leader, then its DCP peers
    gateway: Spec
    world: bool  # the experts and attention ranks meet in one collective world


def render(args: argparse.Namespace, model: Path, name: str, num_experts: int,
           access: list[str]) -> LocalServices:
    """Every child of `serve` with `args`: the topology of its layout, with its flags
    passed on. `access` holds the gateway's API-key flags."""
    tracing = ["--otlp-traces-endpoint", args.otlp_traces_endpoint] \
        if args.otlp_traces_endpoint else []
    common = [*(["--placement", args.placement] if args.placement else []),
              *(["--num-threads", str(args.num_threads)] if args.num_threads else [])]
    expert_flags = [*common, "--quantization", args.quantization, *tracing,
                    "--rendezvous-timeout", str(args.rendezvous_timeout)]
    if backend(args.dispatch_backend).deepep_settings:
        expert_flags += deepep_flags(deepep_settings(args))
    topology = build(num_experts, args.dcp_size, args.attention_groups, args.device, name,
                     args.dispatch_backend, extra={
                         "expert": expert_flags,
                         "attention": engine_flags(args),
                         "gateway": [*serve_flags(args), *access, *tracing]})
    settings = {"DEVICE": args.device, "DTYPE": args.dtype,
                "EXPERT_REPLICAS": str(args.expert_replicas),
                "KV_CACHE_MEMORY": str(args.kv_cache_memory),
                "MAX_NUM_SEQS": str(args.max_num_seqs), "SERVED_MODEL_NAME": name}
    # port 0 is chosen here, as a restarted gateway must listen where the printed URL says
    ports = Ports(args.port or free_port(), args.dist_init or f"{LOOPBACK}:{free_port()}")

    def spec(s: ServiceSet, replica: int, member: int) -> Spec:
        place = LocalPlace(topology, s, replica, member, str(model), ports, settings,
                           args.host)
        return child_name(s.name, replica, member), place.command()[1:]  # without "switchyard"

    return LocalServices(
        experts=[spec(topology.expert, g, 0) for g in range(num_experts)],
        attention=[spec(topology.attention, g, r) for g, r in topology.attention.members()],
        gateway=spec(topology.gateway, 0, 0), world=topology.world)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """Every engine flag of `serve` that the topology does not write, for each attention
    service. A flag added to `add_engine_flags` reaches them with no change here."""
    return as_flags(args, add_engine_flags(argparse.ArgumentParser()), skip=TOPOLOGY_FLAGS)
