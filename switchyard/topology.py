"""One description of a deployment, rendered three ways: `switchyard serve`'s local
processes (`switchyard.local`), docker compose (`switchyard compose`) and Kubernetes
(`switchyard k8s`).

A deployment is three `ServiceSet`s. The expert services are independent members, one per
expert rank. The attention groups are replicas of a rendezvous unit: a DCP group of D
ranks, rank 0 leading. The third is the gateway. A set's command is written once, with
placeholders for what each rendering spells its own way: a member's index, a port, another
service's address, this unit's leader, a deployment setting. A unit's members restart
together, since a rendezvous needs all of them. Compose restarts each service on failure,
and the DCP ranks rejoin. Kubernetes makes each unit a LeaderWorkerSet group, recreated
whole (`RecreateGroupOnPodRestart`), as `serve` restarts a DCP group whole. With a
collective dispatch backend (torch, nccl, deepep), the attention ranks and the expert ranks
are one world (`Topology.world`), one unit.

A rendering subclasses `Place` to spell the placeholders: `switchyard serve` as local
processes on loopback, on ports chosen at start; compose by service name and port;
Kubernetes by DNS name and the pod's own variables (`$(POD_INDEX)`, `$(LWS_WORKER_INDEX)`,
`$(LWS_LEADER_ADDRESS)`). A collective backend's world lists the attention ranks first, then
the expert ranks, each expert joining as its `--world-rank`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ep_dispatch.registry import backend

# The ports a member serves, by name. A rendering may move them: compose on the host's
# network gives each member its own.
SERVE, METRICS, RENDEZVOUS, WORLD = "serve", "metrics", "rendezvous", "world"
BASE_PORTS = {"gateway": {SERVE: 8000},
              "attention": {SERVE: 7000, METRICS: 9400, RENDEZVOUS: 29500},
              "expert": {SERVE: 7100, METRICS: 9400}}
WORLD_PORT = 29600  # a collective backend's rendezvous, on attention rank 0


@dataclass(frozen=True)
class Port:
    """This member's port of that name."""
    name: str


@dataclass(frozen=True)
class Index:
    """This member's replica, which is its attention group or its expert rank, or its
    rank in its unit, which is its DCP rank."""
    of: str  # "replica" | "member"


@dataclass(frozen=True)
class Ref:
    """Where another service is reached: a set's replica's member, at a named port,
    formatted by `fmt`, in which `{}` is HOST:PORT."""
    set: str
    replica: int
    member: int
    port: str
    fmt: str = "{}"


@dataclass(frozen=True)
class Refs:
    """Several `Ref`s, comma-separated."""
    refs: tuple[Ref, ...]


@dataclass(frozen=True)
class Leader:
    """This unit's leader, its member 0, at a named port: a rendezvous. In a collective
    world (`Topology.world`) the leader is attention rank 0, at `WORLD_PORT`."""
    port: str


@dataclass(frozen=True)
class WorldRank:
    """An expert rank's rank in a collective world: the attention ranks come first."""


@dataclass(frozen=True)
class Setting:
    """A deployment setting (SWITCHYARD_<name>), with the value it has by default."""
    name: str
    default: str


@dataclass(frozen=True)
class Bind:
    """The address a member listens on. With `front`, it is the gateway's, which clients
    reach."""
    front: bool = False


MODEL = "{model}"  # the model's path where the services run
Arg = str | Port | Index | Ref | Refs | Leader | Setting | Bind | WorldRank


@dataclass(frozen=True)
class ServiceSet:
    """Services made from one command: `replicas` units of `size` members each."""
    name: str  # expert | attention | gateway: also the `switchyard` subcommand
    replicas: int
    leader: tuple[Arg, ...]  # member 0's flags
    worker: tuple[Arg, ...] = ()  # members 1..size-1's flags
    size: int = 1
    gpus: int = 1  # per member, with --device cuda
    settings: tuple[tuple[str, str], ...] = ()  # read from the environment: name, default
    after: tuple[str, ...] = ()  # the sets that must serve before it starts

    @property
    def ports(self) -> dict[str, int]:
        return BASE_PORTS[self.name]

    def members(self) -> list[tuple[int, int]]:
        """Every (replica, member)."""
        return [(g, r) for g in range(self.replicas) for r in range(self.size)]

    def args(self, member: int) -> tuple[Arg, ...]:
        """Member `member`'s flags. A set of one kind of member has no worker flags; a
        collective world's expert ranks are its workers, each with the same flags."""
        return self.leader if member == 0 or not self.worker else self.worker


@dataclass(frozen=True)
class Topology:
    expert: ServiceSet
    attention: ServiceSet
    gateway: ServiceSet
    device: str = "cuda"
    # A collective backend's world: attention rank 0 (leading) and the expert ranks
    # meet at one rendezvous and restart together, one unit.
    world: bool = False
    sets: dict[str, ServiceSet] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sets", {s.name: s for s in
                                          (self.expert, self.attention, self.gateway)})


# Settings of .env that a service reads as its flags' SWITCHYARD_ variables, as (name
# without the prefix, default).
GATEWAY_SETTINGS = (("ENABLE_AUTO_TOOL_CHOICE", "false"), ("TOOL_CALL_PARSER", ""),
                    ("ENABLE_PROMPT_TOKENS_DETAILS", "false"),
                    ("ROUTING_POLICY", "prefix-affinity"), ("ROUTING_BALANCE", "16"),
                    ("FAILOVER_TIMEOUT", "60"), ("API_KEY", ""), ("ADMIN_API_KEY", ""))
ENGINE_SETTINGS = (("ENABLE_PREFIX_CACHING", "true"),)


def build(expert_services: int, dcp_size: int, attention_groups: int, device: str,
          served_model_name: str, dispatch_backend: str = "rpc",
          extra: Mapping[str, Sequence[str]] | None = None) -> Topology:
    """The services of a layout: E expert services, and G attention groups of D DCP ranks,
    with a gateway in front.

    The experts are reached over `rpc`, or held in the attention service (`local`, E = 0).
    With a collective backend (torch, nccl, deepep), the attention ranks and the expert
    ranks form one world. `extra` gives more flags for every member of a set, by set name;
    `serve` forwards its own.
    """
    dispatch = backend(dispatch_backend)
    world = dispatch.collective
    if dispatch.in_process != (expert_services == 0):
        raise ValueError(f"--dispatch-backend {dispatch_backend} needs "
                         + ("no expert services" if dispatch.in_process
                            else "at least one expert service"))
    if world and dcp_size > 1:
        raise ValueError("DCP works with the local and rpc dispatch backends; a collective "
                         "backend's process group is the expert world")
    more = {name: tuple(flags) for name, flags in (extra or {}).items()}
    gpu = device == "cuda"
    dtype = "auto" if gpu else "float32"  # bf16 matmuls crawl on most CPUs
    on_device = ("--device", Setting("DEVICE", device), "--dtype", Setting("DTYPE", dtype))
    replicas = ("--expert-replicas", Setting("EXPERT_REPLICAS", "1"))  # placed alike
    join = ("--dispatch-backend", dispatch_backend, "--dist-init", Leader(WORLD),
            "--attention-ranks", str(attention_groups))
    rank = ("--world-rank", WorldRank(), *join) if world else \
        ("--port", Port(SERVE), "--rank", Index("replica"))
    expert = ServiceSet("expert", expert_services, (
        "--model", MODEL, "--host", Bind(), *rank, "--num-ranks", str(expert_services),
        *on_device, *replicas, "--metrics-port", Port(METRICS), *more.get("expert", ())))
    kv = "40GiB" if gpu else "1GiB"
    if world:
        experts: tuple[Arg, ...] = (*join, "--attention-rank", Index("replica"),
                                    "--expert-ranks", str(expert_services))
    elif dispatch.in_process:
        experts = ("--dispatch-backend", dispatch_backend, "--attention-rank", Index("replica"))
    else:
        experts = ("--dispatch-backend", dispatch_backend, "--attention-rank", Index("replica"),
                   "--expert-addresses",
                   Refs(tuple(Ref("expert", r, 0, SERVE) for r in range(expert_services))))
    engine = ("--model", MODEL, "--host", Bind(), *on_device,
              "--kv-cache-memory", Setting("KV_CACHE_MEMORY", kv),
              "--max-num-seqs", Setting("MAX_NUM_SEQS", "256"), "--metrics-port", Port(METRICS),
              *replicas, *experts, *more.get("attention", ()))
    dcp = ("--dcp-size", str(dcp_size), "--dcp-init", Leader(RENDEZVOUS)) \
        if dcp_size > 1 else ()
    attention = ServiceSet("attention", attention_groups, (*engine, *dcp, "--port", Port(SERVE)),
                           (*engine, *dcp, "--dcp-rank", Index("member")), size=dcp_size,
                           settings=ENGINE_SETTINGS, after=("expert",))
    scraped = [Ref(s.name, g, r, METRICS, "http://{}/metrics")
               for s in (attention, expert) for g, r in s.members()]
    gateway = ServiceSet("gateway", 1, (
        "--model", MODEL, "--served-model-name", Setting("SERVED_MODEL_NAME", served_model_name),
        "--host", Bind(front=True), "--port", Port(SERVE),
        "--engine", Refs(tuple(Ref("attention", g, 0, SERVE) for g in range(attention_groups))),
        "--service-metrics", Refs(tuple(scraped)), *more.get("gateway", ())), gpus=0,
        settings=GATEWAY_SETTINGS,
        after=("attention",))
    return Topology(expert, attention, gateway, device, world)


def resolve(arg: Arg, place: Place) -> str:
    """One argument as a rendering spells it for the member at `place`."""
    match arg:
        case str():  # a flag's value, JSON's braces included, passes as it is
            return arg.replace("{model}", place.model)
        case Port(name):
            return place.port(name)
        case Index(of):
            return place.index(of)
        case Ref():
            return arg.fmt.format(place.address(arg))
        case Refs(refs):
            return ",".join(resolve(r, place) for r in refs)
        case Leader(port):
            return place.leader(port)
        case Setting(name, default):
            return place.setting(name, default)
        case Bind(front):
            return place.bind(front)
        case WorldRank():
            return place.world_rank()
    raise TypeError(f"not an argument: {arg!r}")


class Place(ABC):
    """How one rendering spells a member's arguments. A rendering subclasses it."""

    def __init__(self, topology: Topology, set: ServiceSet, replica: int, member: int,
                 model: str) -> None:
        self.topology, self.set, self.replica, self.member = topology, set, replica, member
        self.model = model

    def port(self, name: str) -> str:
        return str(self.set.ports[name])

    def index(self, of: str) -> str:
        return str(self.replica if of == "replica" else self.member)

    @abstractmethod
    def address(self, ref: Ref) -> str:
        """HOST:PORT where another member is reached, as this rendering names it."""

    def leader(self, port: str) -> str:
        if port == WORLD:
            return f"{self.address(Ref('attention', 0, 0, SERVE)).rpartition(':')[0]}:" \
                   f"{WORLD_PORT}"
        return self.address(Ref(self.set.name, self.replica, 0, port))

    def setting(self, name: str, default: str) -> str:
        return default

    def bind(self, front: bool) -> str:
        return "0.0.0.0"

    def world_rank(self) -> str:
        return str(self.topology.attention.replicas + self.replica)

    def command(self) -> list[str]:
        """`switchyard <set> FLAGS`, spelt here."""
        return ["switchyard", self.set.name,
                *(resolve(a, self) for a in self.set.args(self.member))]
