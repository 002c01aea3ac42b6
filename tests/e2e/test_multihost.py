"""`switchyard k8s`'s manifests (deploy/k8s/cpu-demo.yaml, as committed) run for real
across hosts, with no cluster: network namespaces on a bridge the test makes
(`tests.support.netns`), one per pod, as Kubernetes gives each pod its own network
namespace and IP, grouped into three nodes (a node's link is cut by cutting its pods');
each pod's container started with the command and environment Kubernetes would give it
(`tests.support.k8s_pods`: the LWS and StatefulSet variables, the downward API's pod IP,
the ConfigMap), names resolved through /etc/netns hosts files. Only the model's path (the
image's) and the mounted cluster secret's are replaced by local ones.

Placement: node a runs the gateway and the attention group's leader (DCP rank 0); node b
its DCP rank 1 and expert rank 0; node c expert rank 1. Every token crosses nodes."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from switchyard.demo_model import DEFAULT_MODEL
from switchyard.k8s import IMAGE_DEMO_MODEL, SECRET, SECRET_DIR
from tests.support import ROOT
from tests.support.k8s_pods import pods
from tests.support.netns import Nodes, netns_missing
from tests.support.tools import wait_until

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(netns_missing() is not None, reason=str(netns_missing())),
]

PLACEMENT = {
    "switchyard-gateway-0": "a",
    "switchyard-attention-0": "a",
    "switchyard-attention-0-1": "b",
    "switchyard-expert-0": "b",
    "switchyard-expert-1": "c",
}
SWITCHYARD = str(Path(sys.executable).parent / "switchyard")
# What the image's environment has besides the pod's (PATH, the caches' home).
BASE_ENV = ("PATH", "HOME", "LANG", "TORCH_EXTENSIONS_DIR")


def netns_name(pod: str) -> str:
    return pod.removeprefix("switchyard-")


class Cluster:
    """The pods of `manifests` started in their namespaces of `nodes`, placed on the three
    nodes by `PLACEMENT`."""

    def __init__(self, nodes: Nodes, manifests: str, tmp: Path) -> None:
        self.nodes = nodes
        key = tmp / "secret"
        key.write_text(secrets.token_hex(32))
        ips = {pod: nodes.address(netns_name(pod)) for pod in PLACEMENT}
        self.pods = {p.name: p for p in pods(manifests, ips, {SECRET: {}})}
        assert sorted(self.pods) == sorted(PLACEMENT)
        for pod in self.pods.values():
            for name in pod.dns:
                nodes.add_alias(netns_name(pod.name), name)
        self.local = {IMAGE_DEMO_MODEL: str(DEFAULT_MODEL), SECRET_DIR: str(tmp)}
        (tmp / "cluster-secret").symlink_to(key)
        self.logs = tmp
        self.procs: dict[str, subprocess.Popen] = {}

    def _local(self, text: str) -> str:
        for image_path, here in self.local.items():
            text = text.replace(image_path, here)
        return text

    def start(self, name: str) -> None:
        pod = self.pods[name]
        env = {k: os.environ[k] for k in BASE_ENV if k in os.environ}
        env.update({k: self._local(v) for k, v in pod.env.items()})
        argv = [SWITCHYARD if a == "switchyard" else self._local(a) for a in pod.command]
        with open(self.logs / f"{name}.log", "wb") as log:
            self.procs[name] = self.nodes.popen(
                netns_name(name), argv, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL
            )

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def ready(self, name: str) -> bool:
        """The pod's readiness probe, run on its node, as the kubelet runs it."""
        pod, node = self.pods[name], netns_name(name)
        if (code := self.procs[name].poll()) is not None:
            raise AssertionError(f"{name} exited ({code}): {self.log(name)[-3000:]}")
        probe = pod.readiness
        if "exec" in probe:
            argv = [SWITCHYARD if a == "switchyard" else a for a in probe["exec"]["command"]]
        else:
            get = probe["httpGet"]
            argv = [SWITCHYARD, "probe", f"http://{pod.env['POD_IP']}:{get['port']}{get['path']}"]
        env = {k: os.environ[k] for k in BASE_ENV if k in os.environ}
        env.update({k: self._local(v) for k, v in pod.env.items()})
        return self.nodes.run(node, argv, env=env, capture_output=True, timeout=30).returncode == 0

    def url(self) -> str:
        return f"http://{self.nodes.address(netns_name('switchyard-gateway-0'))}:8000"

    def cut(self, node: str) -> None:
        """`node`'s link silenced: every pod's on it."""
        for pod in (p for p, n in PLACEMENT.items() if n == node):
            self.nodes.cut(netns_name(pod))

    def restore(self, node: str) -> None:
        for pod in (p for p, n in PLACEMENT.items() if n == node):
            self.nodes.restore(netns_name(pod))

    def client(self, code: str, timeout: float = 300) -> object:
        """Python `code` run in the gateway's pod on node a (the repository importable),
        its stdout as JSON."""
        out = self.nodes.run(
            netns_name("switchyard-gateway-0"),
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp_path = tmp_path_factory.mktemp("cluster")
    manifests = (ROOT / "deploy/k8s/cpu-demo.yaml").read_text()  # as committed
    with Nodes([netns_name(pod) for pod in PLACEMENT]) as nodes:
        c = Cluster(nodes, manifests, tmp_path)
        for name in PLACEMENT:  # all at once, as `kubectl apply` starts them
            c.start(name)
        for name in PLACEMENT:
            wait_until(
                lambda name=name: c.ready(name),
                300,
                lambda name=name: f"{name} ready: {c.log(name)[-2000:]}",
            )
        yield c


def test_no_process_is_configured_with_a_loopback_address(cluster: Cluster) -> None:
    """Every address a service is given is a name or its pod's IP: nothing in any
    command line or environment is a loopback address."""
    for pod in cluster.pods.values():
        for text in [*pod.command, *pod.env.values()]:
            assert not any(loop in text for loop in ("127.", "localhost", "::1")), (pod.name, text)


def test_the_readme_question_across_nodes_and_greedy_parity(cluster: Cluster) -> None:
    """The README's question answered through the gateway on node a, its attention group
    split over a and b, its experts on b and c; greedy token ids equal transformers'."""
    answer = cluster.client(
        "import json, openai\n"
        f"c = openai.OpenAI(base_url='{cluster.url()}/v1', api_key='none', max_retries=0)\n"
        "r = c.chat.completions.create(model='switchyard-arith-moe', temperature=0,"
        " messages=[{'role': 'user', 'content': 'What is 1 + 1?'}])\n"
        "print(json.dumps(r.choices[0].message.content))\n"
    )
    assert answer == "2"
    ps = [[1 + (7 * i + j) % 50 for j in range(5 + 6 * i)] for i in range(4)]
    served = cluster.client(
        "import json\nfrom tests.support.serving import concurrent_greedy\n"
        f"print(json.dumps(concurrent_greedy('{cluster.url()}', 'switchyard-arith-moe', "
        f"{ps}, 12)))\n"
    )
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.engines import reference_greedy

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float32)
    assert served == [reference_greedy(model, p, 12) for p in ps]
