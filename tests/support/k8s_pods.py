"""The pods a set of Kubernetes manifests makes, with each container's command and
environment as Kubernetes (and the LWS and StatefulSet controllers) would give them: for
running `switchyard k8s`'s output as processes on `tests.support.netns` nodes.

What the controllers add is added here: a StatefulSet pod's name `<set>-<i>` and its
`apps.kubernetes.io/pod-index` label; an LWS pod's name (`<lws>-<group>` leading,
`<lws>-<group>-<worker>`), its DNS name under the LWS's headless service, and the
variables LWS puts before a container's own (`LWS_LEADER_ADDRESS`, `LWS_GROUP_SIZE`,
`LWS_WORKER_INDEX`); the downward API's fields; a ConfigMap's data (`envFrom`); then
`$(VAR)` expanded in the env values and the command, as the kubelet does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import yaml

NAMESPACE = "default"


@dataclass
class Pod:
    name: str
    dns: list[str]  # the names it is reached by
    component: str  # app.kubernetes.io/component
    command: list[str]
    env: dict[str, str]
    readiness: dict  # the container's readinessProbe
    labels: dict[str, str] = field(default_factory=dict)


def pods(text: str, pod_ips: dict[str, str], secrets: dict[str, dict[str, str]] | None = None
         ) -> list[Pod]:
    """Every pod of the manifests in `text`; `pod_ips` gives each pod's IP (by pod name),
    `secrets` the Secrets that exist (name -> data)."""
    docs = [d for d in yaml.safe_load_all(text) if d]
    config = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    out: list[Pod] = []
    for doc in docs:
        kind, name, spec = doc["kind"], doc["metadata"]["name"], doc.get("spec", {})
        if kind == "StatefulSet":
            for i in range(spec["replicas"]):
                out.append(_pod(f"{name}-{i}", [f"{name}-{i}.{spec['serviceName']}"],
                                spec["template"], {"apps.kubernetes.io/pod-index": str(i)},
                                {}, pod_ips, config, secrets or {}))
        elif kind == "LeaderWorkerSet":
            template = spec["leaderWorkerTemplate"]
            size = template["size"]
            for g in range(spec["replicas"]):
                for w in range(size):
                    pod = f"{name}-{g}" + (f"-{w}" if w else "")
                    lws = {"LWS_LEADER_ADDRESS": f"{name}-{g}.{name}.{NAMESPACE}",
                           "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(w)}
                    chosen = template.get("leaderTemplate", template["workerTemplate"]) \
                        if w == 0 else template["workerTemplate"]
                    out.append(_pod(pod, [f"{pod}.{name}", f"{pod}.{name}.{NAMESPACE}"],
                                    chosen, {"leaderworkerset.sigs.k8s.io/group-index": str(g),
                                             "leaderworkerset.sigs.k8s.io/worker-index": str(w)},
                                    lws, pod_ips, config, secrets or {}))
        elif kind == "Deployment":
            pod = f"{name}-0"
            out.append(_pod(pod, [], spec["template"], {}, {}, pod_ips, config, secrets or {}))
    return out


def _pod(name: str, dns: list[str], template: dict, labels: dict[str, str],
         first: dict[str, str], pod_ips: dict[str, str], config: dict[str, dict],
         secrets: dict[str, dict[str, str]]) -> Pod:
    [container] = template["spec"]["containers"]
    labels = {**template["metadata"].get("labels", {}), **labels}
    env = dict(first)
    for source in container.get("envFrom", []):
        env.update(config[source["configMapRef"]["name"]])
    fields = {"metadata.name": name, "status.podIP": pod_ips.get(name, ""),
              **{f"metadata.labels['{k}']": v for k, v in labels.items()}}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            data = secrets.get(ref["name"], {})
            if ref["key"] in data:
                env[var["name"]] = data[ref["key"]]
            elif not ref.get("optional"):
                raise KeyError(f"{name}: Secret {ref['name']} has no {ref['key']}")
    command = [expand(a, env) for a in container["command"]]
    return Pod(name, dns, labels.get("app.kubernetes.io/component", ""), command, env,
               container.get("readinessProbe", {}), labels)


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)`: replaced if VAR is defined, else left; `$$` is `$`."""
    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)
