"""`switchyard k8s`: the Kubernetes manifests of a layout, across as many nodes as it takes.

    switchyard k8s --expert-services 12 --dcp-size 2 --attention-groups 2 \\
        --model /models/my-moe --model-claim my-moe > switchyard.yaml
    kubectl create secret generic switchyard-cluster-secret \\
        --from-file=cluster-secret=<(openssl rand -hex 32)
    kubectl apply -f switchyard.yaml

renders, from the same description as `switchyard compose` (`switchyard.topology`):
- the attention groups as one LeaderWorkerSet (leaderworkerset.x-k8s.io/v1), a group of
  D pods per attention group, with DCP rank 0 the leader. A group is recreated whole when
  one of its pods restarts (`RecreateGroupOnPodRestart`), since the rendezvous needs every
  rank, as `serve` restarts a DCP group whole. The DCP rendezvous is at
  `$(LWS_LEADER_ADDRESS)`, and each rank is `$(LWS_WORKER_INDEX)`;
- the expert services as a StatefulSet with a headless Service: expert rank i is pod
  `switchyard-expert-i`, reached at `switchyard-expert-i.switchyard-expert`;
- the gateway as a Deployment and a Service (port 8000).
Each service listens on every address of its pod and is reached by its name. Each pod
proves the cluster secret (the Secret `switchyard-cluster-secret`) on its connections.
A real cluster adds the LWS controller, the NVIDIA GPU operator, and, for NCCL across
nodes, RDMA (docs/deploy.md).

A ConfigMap holds the deployment's settings. A collective backend's world is one
LeaderWorkerSet group. Every internal connection fails within `--link-timeout` when a link
between nodes is cut (`common.rpc.set_liveness`), so the crash failover runs.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from switchyard.compose import dump  # one YAML style for both
from switchyard.demo_model import DEFAULT_MODEL_NAME
from switchyard.topology import (
    BASE_PORTS,
    METRICS,
    SERVE,
    WORLD,
    WORLD_PORT,
    Place,
    Ref,
    ServiceSet,
    Setting,
    Topology,
    build,
)

PREFIX = "switchyard"
SECRET = "switchyard-cluster-secret"  # kubectl create secret generic ... (the module doc)
SECRET_DIR = "/run/secrets/switchyard"
KEYS = "switchyard-api-keys"  # optional Secret: api-key, admin-api-key
# Where the image keeps the bundled demo model (Dockerfile: the source at /opt/switchyard/src).
IMAGE_DEMO_MODEL = "/opt/switchyard/src/switchyard/models/arith-moe"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # a StatefulSet pod's ordinal (k8s 1.28+)
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"  # an LWS pod's group
WORLD_SET = "world"  # the LWS of a collective backend's world
SETTINGS = "switchyard-settings"  # the ConfigMap of deployment settings (compose's .env)
LAYOUT_SETTINGS = ("DEVICE", "DTYPE")  # fixed by the rendering: not settings here


@dataclass(frozen=True)
class K8sLayout:
    expert_services: int = 6
    dcp_size: int = 2
    attention_groups: int = 1
    device: str = "cuda"
    model: str = IMAGE_DEMO_MODEL  # the model's directory inside the pods
    model_claim: str = ""  # a PersistentVolumeClaim holding it, mounted read-only there
    image: str = "switchyard:latest"
    otlp_endpoint: str = "http://otel-collector:4318"
    served_model_name: str = ""
    dispatch_backend: str = "rpc"  # or torch: one collective world, one LWS group

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"

    def topology(self) -> Topology:
        if min(self.expert_services, self.dcp_size, self.attention_groups) < 1:
            raise ValueError("--expert-services, --dcp-size and --attention-groups must be at "
                             "least 1")
        if self.dispatch_backend != "rpc" and (self.dispatch_backend != "torch" or
                                               self.attention_groups != 1 or self.dcp_size != 1):
            raise ValueError(f"--dispatch-backend {self.dispatch_backend}: only rpc, or torch "
                             f"with one attention group and no DCP (its world is one LWS "
                             f"group), is rendered")
        name = self.served_model_name or ("switchyard" if self.gpu else DEFAULT_MODEL_NAME)
        return build(self.expert_services, self.dcp_size, self.attention_groups, self.device,
                     name, self.dispatch_backend)


def dns_name(set: str, replica: int, member: int, world: bool = False) -> str:
    """A pod's name in the cluster's DNS, which the namespace's search path completes.

    It is the StatefulSet's `<set>-<i>.<set>`, or LWS's `<lws>-<group>[-<worker>].<lws>`.
    In a collective world, one LWS group (`WORLD_SET`), attention rank 0 leads and expert
    rank r is worker r + 1.
    """
    if world and set != "gateway":
        return dns_name(WORLD_SET, 0, 0 if set == "attention" else replica + 1)
    pod = f"{PREFIX}-{set}-{replica}" + (f"-{member}" if member else "")
    return f"{pod}.{PREFIX}-{set}" if set != "gateway" else f"{PREFIX}-gateway"


class K8sPlace(Place):
    """Kubernetes' spelling, for a set's pod template, whose replica and member stand for
    any. Ranks come from the pod's own variables, and others are reached by DNS name.
    Settings are spelt as their defaults, which SWITCHYARD_ variables in the environment
    override."""

    def index(self, of: str) -> str:
        if of == "member":
            return "$(LWS_WORKER_INDEX)"
        if self.topology.world and self.set.name == "attention":
            return str(self.replica)  # the world's only attention rank: 0
        if self.set.name == "attention":
            return "$(GROUP_INDEX)"  # its LWS group's index
        if self.set.name != "expert":
            raise ValueError(f"{self.set.name}: only a StatefulSet's pods know their replica")
        return "$(POD_INDEX)"

    def address(self, ref: Ref) -> str:
        port = self.topology.sets[ref.set].ports[ref.port]
        return f"{dns_name(ref.set, ref.replica, ref.member, self.topology.world)}:{port}"

    def leader(self, port: str) -> str:
        number = WORLD_PORT if port == WORLD else self.set.ports[port]
        return f"$(LWS_LEADER_ADDRESS):{number}"

    def world_rank(self) -> str:
        return "$(LWS_WORKER_INDEX)"  # the world's LWS group: attention rank 0 leads

    def setting(self, name: str, default: str) -> str:
        """The layout's own settings as rendered, since the device decides the resources.
        The others come from the ConfigMap every pod reads (`settings`), as compose's come
        from .env."""
        return default if name in LAYOUT_SETTINGS else f"$(SWITCHYARD_{name})"


def render(layout: K8sLayout) -> list[dict]:
    """Every object of `layout`, in the order `kubectl apply` should meet them."""
    topology = layout.topology()
    if topology.world:
        return [settings(topology), _world_lws(layout, topology), *_gateway(layout, topology)]
    return [settings(topology), _headless(topology.expert),
            _expert_statefulset(layout, topology),
            _attention_lws(layout, topology), *_gateway(layout, topology)]


def settings(topology: Topology) -> dict:
    """Every setting a command or service reads, with its default. Edit this ConfigMap,
    or patch it, as you would compose's .env."""
    found: dict[str, str] = {}

    def collect(arg: object) -> None:
        if isinstance(arg, Setting) and arg.name not in LAYOUT_SETTINGS:
            found[f"SWITCHYARD_{arg.name}"] = arg.default

    for s in topology.sets.values():
        for arg in (*s.leader, *s.worker):
            collect(arg)
        found.update({f"SWITCHYARD_{k}": v for k, v in s.settings
                      if k not in ("API_KEY", "ADMIN_API_KEY")})  # the keys are in a Secret
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": SETTINGS, "labels": {"app.kubernetes.io/name": PREFIX}},
            "data": found}


def _labels(set: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": PREFIX, "app.kubernetes.io/component": set}


def _headless(s: ServiceSet) -> dict:
    """Stable names for a StatefulSet's pods, resolvable before they are ready. The
    attention services retry until the experts answer."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": f"{PREFIX}-{s.name}", "labels": _labels(s.name)},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": _labels(s.name),
                     "ports": [{"name": n, "port": p} for n, p in s.ports.items()]}}


def _expert_statefulset(layout: K8sLayout, topology: Topology) -> dict:
    s = topology.expert
    pod = _pod(layout, K8sPlace(topology, s, 0, 0, layout.model), [_pod_index_env()])
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": f"{PREFIX}-expert", "labels": _labels("expert")},
            "spec": {"serviceName": f"{PREFIX}-expert", "replicas": s.replicas,
                     "podManagementPolicy": "Parallel",  # independent ranks: no order
                     "selector": {"matchLabels": _labels("expert")},
                     "template": {"metadata": _pod_metadata("expert"), "spec": pod}}}


def _attention_lws(layout: K8sLayout, topology: Topology) -> dict:
    """The attention groups: one LWS group each, of its DCP ranks."""
    s = topology.attention
    leader = _pod(layout, K8sPlace(topology, s, 0, 0, layout.model), [_group_index_env()])
    template: dict = {"size": s.size, "restartPolicy": "RecreateGroupOnPodRestart"}
    if s.size > 1:
        template["leaderTemplate"] = {"metadata": _pod_metadata("attention"), "spec": leader}
        worker = _pod(layout, K8sPlace(topology, s, 0, 1, layout.model), [_group_index_env()])
        template["workerTemplate"] = {"metadata": _pod_metadata("attention"), "spec": worker}
    else:  # a group of one: its only pod is the leader
        template["workerTemplate"] = {"metadata": _pod_metadata("attention"), "spec": leader}
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": f"{PREFIX}-attention", "labels": _labels("attention")},
            "spec": {"replicas": s.replicas, "startupPolicy": "LeaderCreated",
                     "leaderWorkerTemplate": template}}


def _world_lws(layout: K8sLayout, topology: Topology) -> dict:
    """A collective backend's world as one LWS group. Attention rank 0 leads, as it hosts
    the rendezvous, and expert rank r is worker r + 1 (`--world-rank $(LWS_WORKER_INDEX)`).
    The world restarts whole, as `serve` restarts it."""
    attention, expert = topology.attention, topology.expert
    leader = _pod(layout, K8sPlace(topology, attention, 0, 0, layout.model), [])
    worker = _pod(layout, K8sPlace(topology, expert, 0, 1, layout.model), [])
    template = {"size": 1 + expert.replicas, "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {"metadata": _pod_metadata("attention"), "spec": leader},
                "workerTemplate": {"metadata": _pod_metadata("expert"), "spec": worker}}
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": f"{PREFIX}-{WORLD_SET}", "labels": _labels(WORLD_SET)},
            "spec": {"replicas": 1, "startupPolicy": "LeaderCreated",
                     "leaderWorkerTemplate": template}}


def _gateway(layout: K8sLayout, topology: Topology) -> list[dict]:
    s = topology.gateway
    pod = _pod(layout, K8sPlace(topology, s, 0, 0, layout.model), [])
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                  "metadata": {"name": f"{PREFIX}-gateway", "labels": _labels("gateway")},
                  "spec": {"replicas": 1, "selector": {"matchLabels": _labels("gateway")},
                           "template": {"metadata": _pod_metadata("gateway", SERVE),
                                        "spec": pod}}}
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": f"{PREFIX}-gateway", "labels": _labels("gateway")},
               "spec": {"selector": _labels("gateway"),
                        "ports": [{"name": "http", "port": s.ports[SERVE],
                                   "targetPort": s.ports[SERVE]}]}}
    return [deployment, service]


def _pod_metadata(set: str, metrics: str = METRICS) -> dict:
    """Labels, and where Prometheus scrapes; for the gateway, its own /metrics."""
    return {"labels": _labels(set),
            "annotations": {"prometheus.io/scrape": "true",
                            "prometheus.io/port": str(BASE_PORTS[set][metrics]),
                            "prometheus.io/path": "/metrics"}}


def _pod_index_env() -> dict:
    return {"name": "POD_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}}


def _group_index_env() -> dict:
    return {"name": "GROUP_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.labels['{GROUP_INDEX_LABEL}']"}}}


def _pod(layout: K8sLayout, place: K8sPlace, env: list[dict]) -> dict:
    """One pod: the container, its volumes, no privileges."""
    s = place.set
    volumes: list[dict] = [{"name": "cluster-secret", "secret": {"secretName": SECRET}}]
    mounts: list[dict] = [{"name": "cluster-secret", "mountPath": SECRET_DIR,
                           "readOnly": True}]
    if layout.model_claim:
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": layout.model_claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": layout.model, "readOnly": True})
    if s.name != "gateway":  # NCCL and the CPU kernels' workers use /dev/shm
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    container = {
        "name": s.name,
        "image": layout.image,
        "command": place.command(),
        "envFrom": [{"configMapRef": {"name": SETTINGS}}],
        "env": [*env, *_env(layout, place)],
        "ports": [{"name": n, "containerPort": p} for n, p in s.ports.items()],
        "resources": _resources(layout, s),
        **_probes(place),
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]}},
    }
    return {"securityContext": {"runAsNonRoot": True, "runAsUser": 10001,  # the image's
                                "runAsGroup": 10001, "fsGroup": 10001},
            "containers": [container], "volumes": volumes}


def _env(layout: K8sLayout, place: K8sPlace) -> list[dict]:
    name = f"{place.set.name}-$(POD_NAME)"
    out = [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "SWITCHYARD_CLUSTER_SECRET_FILE", "value": f"{SECRET_DIR}/cluster-secret"},
           # gloo and NCCL bootstrap on the pod's network, not what the hostname resolves to
           {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"},
           {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"},
           {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": layout.otlp_endpoint},
           {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
           {"name": "OTEL_TRACES_SAMPLER_ARG", "value": "0.01"},
           {"name": "OTEL_RESOURCE_ATTRIBUTES", "value": f"service.instance.id={name}"}]
    if place.set.name != "gateway" and not layout.gpu:
        out.append({"name": "OMP_WAIT_POLICY", "value": "PASSIVE"})  # cores are shared
    for key, _ in place.set.settings:
        if key in ("API_KEY", "ADMIN_API_KEY"):
            out.append({"name": f"SWITCHYARD_{key}", "valueFrom": {"secretKeyRef": {
                "name": KEYS, "key": key.lower().replace("_", "-"), "optional": True}}})
    return out


def _resources(layout: K8sLayout, s: ServiceSet) -> dict:
    """A GPU per attention and expert pod; on the CPU profile, cores and memory."""
    if layout.gpu and s.gpus:
        return {"limits": {"nvidia.com/gpu": s.gpus},
                "requests": {"cpu": "4", "memory": "32Gi"}}
    memory = "2Gi" if s.name == "attention" else "1Gi"
    return {"requests": {"cpu": "1", "memory": memory}, "limits": {"memory": "8Gi"}}


def _probes(place: K8sPlace) -> dict:
    """Startup, readiness and liveness probes on what means serving. Startup allows for
    loading the model, up to 20 min. The probes are the gateway's /health, which needs
    every group warm; an attention or expert service answering an InfoRequest after the
    cluster-secret handshake; and a DCP rank's /metrics, served once it joined its group."""
    s = place.set
    if s.name == "gateway":
        check: dict = {"httpGet": {"path": "/health", "port": s.ports[SERVE]}}
    elif place.member == 0:
        check = {"exec": {"command": ["switchyard", "probe", "--timeout", "3",
                                      f"127.0.0.1:{s.ports[SERVE]}"]}}
    else:
        check = {"httpGet": {"path": "/metrics", "port": s.ports[METRICS]}}
    timing = {"timeoutSeconds": 5}
    return {"startupProbe": {**check, **timing, "periodSeconds": 10, "failureThreshold": 120},
            "readinessProbe": {**check, **timing, "periodSeconds": 5, "failureThreshold": 3},
            "livenessProbe": {**check, **timing, "periodSeconds": 10, "failureThreshold": 6}}


HEADER = """\
# Switchyard on Kubernetes: rendered by `switchyard k8s {args}`
# (tests/switchyard/test_k8s.py keeps the committed examples equal to that, and valid).
# Needs the LeaderWorkerSet controller (LWS), and on GPU nodes the NVIDIA GPU operator.
#   kubectl create secret generic switchyard-cluster-secret \\
#       --from-file=cluster-secret=<(openssl rand -hex 32)
#   kubectl apply -f THIS_FILE
# Chat: kubectl port-forward svc/switchyard-gateway 8000, then http://127.0.0.1:8000/v1
"""


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="switchyard k8s", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--expert-services", type=int, default=6)
    ap.add_argument("--dcp-size", type=int, default=2)
    ap.add_argument("--attention-groups", type=int, default=1)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the same services with no GPU, CPU and memory requests")
    ap.add_argument("--model", default=IMAGE_DEMO_MODEL,
                    help="the model's directory inside the pods (default: the demo model "
                         "the image holds)")
    ap.add_argument("--model-claim", default="",
                    help="a PersistentVolumeClaim holding the model, mounted read-only at "
                         "--model")
    ap.add_argument("--image", default="switchyard:latest")
    ap.add_argument("--served-model-name", default="")
    ap.add_argument("--otlp-endpoint", default="http://otel-collector:4318",
                    help="where every pod sends its traces (OTLP over HTTP)")
    ap.add_argument("--dispatch-backend", choices=["rpc", "torch"], default="rpc",
                    help="torch: the attention rank and the expert ranks as one collective "
                         "world (gloo, or NCCL on GPUs), one LWS group; one attention group, "
                         "no DCP")
    args = ap.parse_args(argv)
    layout = K8sLayout(args.expert_services, args.dcp_size, args.attention_groups,
                       args.device, args.model, args.model_claim, args.image,
                       args.otlp_endpoint, args.served_model_name, args.dispatch_backend)
    try:
        docs = render(layout)
    except ValueError as exc:
        print(f"switchyard k8s: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(HEADER.format(args=" ".join(argv)) +
                     "---\n".join(dump(d) for d in docs))
    return 0
