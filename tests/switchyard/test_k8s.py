"""`switchyard k8s`: the committed examples under deploy/k8s/ are what it renders, and
valid (Kubernetes' schemas offline, the LWS objects against LWS's own CRD); each layout
gets the objects docs/deploy.md describes (run for real across network namespaces:
tests/e2e/test_multihost.py)."""

from __future__ import annotations

import contextlib
import io

import pytest
import yaml

from switchyard.k8s import IMAGE_DEMO_MODEL, K8sLayout, main, render
from tests.support import ROOT
from tests.support.k8s_validate import validate

pytestmark = pytest.mark.timeout(300)

# Each committed example and the arguments that render it.
EXAMPLES = {
    "cpu-demo.yaml": ["--device", "cpu", "--expert-services", "2", "--dcp-size", "2"],
    "one-node-8-gpus.yaml": ["--expert-services", "6", "--dcp-size", "2", "--model",
                             "/models/moe", "--model-claim", "switchyard-model"],
    "two-nodes-16-gpus-dcp.yaml": ["--expert-services", "12", "--dcp-size", "2",
                                   "--attention-groups", "2", "--model", "/models/moe",
                                   "--model-claim", "switchyard-model"],
}


def _rendered(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_committed_example_is_the_rendering_and_valid(name: str) -> None:
    text = (ROOT / "deploy/k8s" / name).read_text()
    assert text == _rendered(EXAMPLES[name]), \
        f"re-render: switchyard k8s {' '.join(EXAMPLES[name])} > deploy/k8s/{name}"
    assert validate(text) == []


def _by_kind(layout: K8sLayout) -> dict[str, dict]:
    return {d["kind"]: d for d in render(layout)}


def test_gpu_layout_objects() -> None:
    """2 groups of 2 DCP ranks as one LWS recreated whole; 12 experts as a StatefulSet with
    stable names; every pod unprivileged, with the cluster secret, probes, a GPU each."""
    objs = _by_kind(K8sLayout(expert_services=12, dcp_size=2, attention_groups=2))
    lws = objs["LeaderWorkerSet"]["spec"]
    assert lws["replicas"] == 2
    template = lws["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    assert "--dcp-init" in leader["command"] and \
        leader["command"][leader["command"].index("--dcp-init") + 1] == \
        "$(LWS_LEADER_ADDRESS):29500"
    assert worker["command"][worker["command"].index("--dcp-rank") + 1] == \
        "$(LWS_WORKER_INDEX)"
    addresses = leader["command"][leader["command"].index("--expert-addresses") + 1]
    assert addresses.split(",") == [f"switchyard-expert-{i}.switchyard-expert:7100"
                                    for i in range(12)]
    sts = objs["StatefulSet"]["spec"]
    assert sts["replicas"] == 12 and sts["serviceName"] == "switchyard-expert"
    expert = sts["template"]["spec"]["containers"][0]
    assert expert["command"][expert["command"].index("--rank") + 1] == "$(POD_INDEX)"
    docs = render(K8sLayout(expert_services=12, dcp_size=2, attention_groups=2))
    [headless] = [d for d in docs if d["metadata"]["name"] == "switchyard-expert"
                  and d["kind"] == "Service"]
    assert headless["spec"]["clusterIP"] == "None"
    for doc in docs:
        for spec in _pod_specs(doc):
            assert spec["securityContext"]["runAsNonRoot"] is True
            [c] = spec["containers"]
            assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"]}}
            assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c)
            assert any(v.get("secret", {}).get("secretName") == "switchyard-cluster-secret"
                       for v in spec["volumes"])
            gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
            assert gpus == (None if c["name"] == "gateway" else 1)


def test_cpu_layout_requests_cores_not_gpus() -> None:
    for doc in render(K8sLayout(device="cpu", expert_services=2, dcp_size=1)):
        for spec in _pod_specs(doc):
            [c] = spec["containers"]
            assert "nvidia.com/gpu" not in yaml.safe_dump(c["resources"])
            assert c["resources"]["requests"]["cpu"]
            assert IMAGE_DEMO_MODEL in c["command"]


def test_impossible_layout_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--expert-services", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


def _pod_specs(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    if "template" in spec:
        return [spec["template"]["spec"]]
    template = spec.get("leaderWorkerTemplate", {})
    return [t["spec"] for k, t in template.items() if k.endswith("Template")]


def test_a_torch_world_is_one_lws_group() -> None:
    """`--dispatch-backend torch`: attention rank 0 leads one LWS group whose workers are
    the expert ranks (`--world-rank $(LWS_WORKER_INDEX)`), all meeting at the leader;
    valid; no StatefulSet. A layout it cannot render is a clear error."""
    docs = render(K8sLayout(device="cpu", expert_services=3, dcp_size=1,
                            dispatch_backend="torch"))
    assert validate("---\n".join(yaml.safe_dump(d) for d in docs)) == []
    assert [d["kind"] for d in docs] == ["ConfigMap", "LeaderWorkerSet", "Deployment",
                                         "Service"]
    template = docs[1]["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 4 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = template["leaderTemplate"]["spec"]["containers"][0]["command"]
    worker = template["workerTemplate"]["spec"]["containers"][0]["command"]
    assert leader[:2] == ["switchyard", "attention"] and worker[:2] == ["switchyard", "expert"]
    for command in (leader, worker):
        assert command[command.index("--dist-init") + 1] == "$(LWS_LEADER_ADDRESS):29600"
    assert worker[worker.index("--world-rank") + 1] == "$(LWS_WORKER_INDEX)"
    with pytest.raises(ValueError, match="torch with one attention group and no DCP"):
        render(K8sLayout(dcp_size=2, dispatch_backend="torch"))
