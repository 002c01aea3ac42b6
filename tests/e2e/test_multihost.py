"""`switchyard k8s`'s manifests run for real across hosts, with no cluster: network
namespaces on a bridge the test makes (`tests.support.netns`), one per pod, as Kubernetes
gives each pod its own network namespace and IP, grouped into three nodes (a node's link
is cut by cutting its pods'); each pod's container started with the command and
environment Kubernetes would give it (`tests.support.k8s_pods`: the LWS and StatefulSet
variables, the downward API's pod IP, the ConfigMap), names resolved through /etc/netns
hosts files. Only the model's path (the image's) and the mounted cluster secret's are
replaced by local ones; a setting is changed in the ConfigMap, as an operator would.

Three deployments, one at a time:
- "demo": deploy/k8s/cpu-demo.yaml as committed. Node a runs the gateway and the
  attention group's leader (DCP rank 0); node b its DCP rank 1 and expert rank 0; node c
  expert rank 1. Every token crosses nodes.
- "replicas": the same with SWITCHYARD_EXPERT_REPLICAS=2 (both expert ranks hold every
  expert).
- "groups": two attention groups without DCP, group 1 on node b.
- "torch": `--dispatch-backend torch`: the attention rank (node a) and the expert ranks
  (nodes b and c) one gloo world, one LWS group.

A cut link drops every frame (no reset, no ICMP): the services find out by
`--link-timeout` (5 s by default), as on a real partition."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from switchyard.compose import dump
from switchyard.demo_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from switchyard.k8s import IMAGE_DEMO_MODEL, SECRET, SECRET_DIR, K8sLayout, render
from tests.support import ROOT
from tests.support.k8s_pods import pods
from tests.support.netns import Nodes, netns_missing, read_line
from tests.support.tools import wait_until

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(netns_missing() is not None, reason=str(netns_missing()))]

SWITCHYARD = str(Path(sys.executable).parent / "switchyard")
# What the image's environment has besides the pod's (PATH, the caches' home).
BASE_ENV = ("PATH", "HOME", "LANG", "TORCH_EXTENSIONS_DIR")
LINK_TIMEOUT = 4.0  # --link-timeout's default (the aim: a loss found within 5 s)
SLACK = 2.0  # keep-alive probes' and polling's granularity
EXPERT_TIMEOUT = "15"  # SWITCHYARD_EXPERT_TIMEOUT in the ConfigMap of "demo"
MAX_TOKENS = 12
PROMPTS = [[1 + (7 * i + j) % 50 for j in range(5 + 6 * i)] for i in range(4)]

DEMO_PLACEMENT = {"switchyard-gateway-0": "a", "switchyard-attention-0": "a",
                  "switchyard-attention-0-1": "b", "switchyard-expert-0": "b",
                  "switchyard-expert-1": "c"}
GROUPS_PLACEMENT = {"switchyard-gateway-0": "a", "switchyard-attention-0": "a",
                    "switchyard-attention-1": "b", "switchyard-expert-0": "b",
                    "switchyard-expert-1": "c"}


def demo_manifests() -> str:
    return (ROOT / "deploy/k8s/cpu-demo.yaml").read_text()  # as committed


def groups_manifests() -> str:
    layout = K8sLayout(expert_services=2, dcp_size=1, attention_groups=2, device="cpu")
    return "---\n".join(dump(d) for d in render(layout))


def torch_manifests() -> str:
    layout = K8sLayout(expert_services=2, dcp_size=1, device="cpu", dispatch_backend="torch")
    return "---\n".join(dump(d) for d in render(layout))


DEPLOYMENTS: dict[str, tuple[Callable[[], str], dict[str, str], dict[str, str]]] = {
    "demo": (demo_manifests, DEMO_PLACEMENT, {"SWITCHYARD_EXPERT_TIMEOUT": EXPERT_TIMEOUT}),
    "replicas": (demo_manifests, DEMO_PLACEMENT, {"SWITCHYARD_EXPERT_REPLICAS": "2"}),
    "groups": (groups_manifests, GROUPS_PLACEMENT, {}),
    "torch": (torch_manifests, {"switchyard-gateway-0": "a", "switchyard-world-0": "a",
                                "switchyard-world-0-1": "b", "switchyard-world-0-2": "c"}, {}),
}


def netns_name(pod: str) -> str:
    return pod.removeprefix("switchyard-")


def with_settings(manifests: str, settings: dict[str, str]) -> str:
    """`manifests` with `settings` put in their ConfigMap."""
    docs = [d for d in yaml.safe_load_all(manifests) if d]
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            doc["data"].update(settings)
    return yaml.safe_dump_all(docs, sort_keys=False)


class Cluster:
    """The pods of `manifests` started in their namespaces of `nodes`, on the nodes
    `placement` names."""

    def __init__(self, nodes: Nodes, manifests: str, placement: dict[str, str],
                 tmp: Path) -> None:
        self.nodes, self.placement = nodes, placement
        key = tmp / "secret"
        key.write_text(secrets.token_hex(32))
        ips = {pod: nodes.address(netns_name(pod)) for pod in placement}
        self.pods = {p.name: p for p in pods(manifests, ips, {SECRET: {}})}
        assert sorted(self.pods) == sorted(placement)
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

    def _env(self, name: str) -> dict[str, str]:
        env = {k: os.environ[k] for k in BASE_ENV if k in os.environ}
        env.update({k: self._local(v) for k, v in self.pods[name].env.items()})
        return env

    def start(self, name: str) -> None:
        argv = [SWITCHYARD if a == "switchyard" else self._local(a)
                for a in self.pods[name].command]
        with open(self.logs / f"{name}.log", "wb") as log:
            self.procs[name] = self.nodes.popen(netns_name(name), argv, env=self._env(name),
                                                stdout=log, stderr=log,
                                                stdin=subprocess.DEVNULL)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def ready(self, name: str) -> bool:
        """The pod's readiness probe, run in its namespace, as the kubelet runs it."""
        pod = self.pods[name]
        if (code := self.procs[name].poll()) is not None:
            raise AssertionError(f"{name} exited ({code}): {self.log(name)[-3000:]}")
        if "exec" in (probe := pod.readiness):
            argv = [SWITCHYARD if a == "switchyard" else a for a in probe["exec"]["command"]]
        else:
            get = probe["httpGet"]
            argv = [SWITCHYARD, "probe",
                    f"http://{pod.env['POD_IP']}:{get['port']}{get['path']}"]
        return self.nodes.run(netns_name(name), argv, env=self._env(name),
                              capture_output=True, timeout=30).returncode == 0

    def url(self) -> str:
        return f"http://{self.nodes.address(netns_name('switchyard-gateway-0'))}:8000"

    def on(self, node: str) -> list[str]:
        """The pods on `node`."""
        return [pod for pod, n in self.placement.items() if n == node]

    @contextlib.contextmanager
    def cut(self, pods: list[str]) -> Iterator[float]:
        """`pods`' links silenced while in the context; yields when, by the wall clock."""
        for pod in pods:
            self.nodes.cut(netns_name(pod))
        try:
            yield time.time()
        finally:
            for pod in pods:
                self.nodes.restore(netns_name(pod))

    def wait_logged(self, name: str, pattern: str, timeout: float) -> None:
        """Until `name`'s log has a line matching `pattern`."""
        wait_until(lambda: re.search(pattern, self.log(name)), timeout,
                   lambda: f"{pattern!r} in {name}'s log: {self.log(name)[-2000:]}")

    def recreate(self, names: list[str]) -> None:
        """What LWS's `RecreateGroupOnPodRestart` does: every pod of the group killed (if
        still running) and started again; back once ready."""
        for name in names:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.procs[name].pid, signal.SIGKILL)
            self.procs[name].wait(30)
            self.logs.joinpath(f"{name}.log").rename(self.logs / f"{name}.before.log")
        for name in names:
            self.start(name)
        for name in names:
            wait_until(lambda name=name: self.ready(name), 300,
                       lambda name=name: f"{name} ready: {self.log(name)[-2000:]}")

    def client(self, code: str, timeout: float = 300) -> object:
        """Python `code` run in the gateway's pod's namespace (the repository importable),
        its stdout as JSON."""
        out = self.nodes.run(netns_name("switchyard-gateway-0"), [sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    @contextlib.contextmanager
    def load(self) -> Iterator[Load]:
        """8 clients in the gateway's namespace, sending greedy `PROMPTS` while in the
        context, 8 answers in before it is entered; every result in `results` after."""
        proc = self.nodes.popen(
            netns_name("switchyard-gateway-0"),
            [sys.executable, "-m", "tests.support.load_clients", self.url(),
             DEFAULT_MODEL_NAME, json.dumps(PROMPTS), "--clients", "8",
             "--max-tokens", str(MAX_TOKENS)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        load = Load(proc)
        try:
            load.answered(8)
            yield load
        finally:
            load.results = load.stop()


class Load:
    """Running `tests.support.load_clients`: its answers as they come."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines = proc, []
        self.results: list[dict] = []  # once stopped

    def answered(self, n: int, timeout: float = 120) -> None:
        """Wait for `n` more answers."""
        for _ in range(n):
            self.lines.append(read_line(self.proc, timeout))

    def until(self, pattern: str, timeout: float) -> str:
        """Wait for an answer line matching `pattern`."""
        deadline = time.monotonic() + timeout
        while not re.match(pattern, line := read_line(self.proc, deadline - time.monotonic())):
            self.lines.append(line)
        return line

    def stop(self, timeout: float = 180) -> list[dict]:
        """Every request's result, once those in flight finished."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"stop\n")
        self.proc.stdin.close()
        while not (line := read_line(self.proc, timeout)).startswith("result "):
            self.lines.append(line)
        self.proc.wait(30)
        return json.loads(line.removeprefix("result "))


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """transformers' greedy continuation of each of `PROMPTS`."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.engines import reference_greedy
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, torch_dtype=torch.float32)
    return [reference_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    """The deployment named by the test's `cluster` parameter, serving."""
    make, placement, settings = DEPLOYMENTS[request.param]
    tmp_path = tmp_path_factory.mktemp(request.param)
    with Nodes([netns_name(pod) for pod in placement]) as nodes:
        c = Cluster(nodes, with_settings(make(), settings), placement, tmp_path)
        for name in placement:  # all at once, as `kubectl apply` starts them
            c.start(name)
        for name in placement:
            wait_until(lambda name=name: c.ready(name), 300,
                       lambda name=name: f"{name} ready: {c.log(name)[-2000:]}")
        yield c


def logged_at(log: str, pattern: str) -> float:
    """When the first log line matching `pattern` was written (wall clock)."""
    m = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*" + pattern, log, re.M)
    assert m, f"no {pattern!r} in: {log[-3000:]}"
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def assert_all_answered(results: list[dict], expected: list[list[int]]) -> None:
    failed = [r for r in results if "tokens" not in r]
    assert not failed, f"{len(failed)} of {len(results)} failed: {failed[:3]}"
    assert all(r["tokens"] == expected[r["prompt"]] for r in results)


demo = pytest.mark.parametrize("cluster", ["demo"], indirect=True)


@demo
def test_no_process_is_configured_with_a_loopback_address(cluster: Cluster) -> None:
    """Every address a service is given is a name or its pod's IP: nothing in any
    command line or environment is a loopback address."""
    for pod in cluster.pods.values():
        for text in [*pod.command, *pod.env.values()]:
            assert not any(loop in text for loop in ("127.", "localhost", "::1")), \
                (pod.name, text)


@demo
def test_the_readme_question_across_nodes_and_greedy_parity(
        cluster: Cluster, expected: list[list[int]]) -> None:
    """The README's question answered through the gateway on node a, its attention group
    split over a and b (DCP over gloo), its experts on b and c (rpc); greedy token ids
    equal transformers'."""
    answer = cluster.client(
        "import json, openai\n"
        f"c = openai.OpenAI(base_url='{cluster.url()}/v1', api_key='none', max_retries=0)\n"
        f"r = c.chat.completions.create(model='{DEFAULT_MODEL_NAME}', temperature=0,"
        " messages=[{'role': 'user', 'content': 'What is 1 + 1?'}])\n"
        "print(json.dumps(r.choices[0].message.content))\n")
    assert answer == "2"
    served = cluster.client(
        "import json\nfrom tests.support.serving import concurrent_greedy\n"
        f"print(json.dumps(concurrent_greedy('{cluster.url()}', '{DEFAULT_MODEL_NAME}', "
        f"{PROMPTS}, {MAX_TOKENS})))\n")
    assert served == expected


@demo
def test_a_cut_expert_node_without_replicas_holds_until_it_is_back(
        cluster: Cluster, expected: list[list[int]]) -> None:
    """Node c (expert rank 1, whose experts no other rank holds) cut under 8 clients: the
    attention service finds the rank lost within the link timeout and holds its step;
    the link back within --expert-timeout, the held call is sent again and every request
    is transformers' tokens."""
    attention = "switchyard-attention-0"
    with cluster.load() as load:
        with cluster.cut(cluster.on("c")) as cut:
            cluster.wait_logged(attention, "holding the step", 30)
        cluster.wait_logged(attention, "is back: the held layer call is sent again",
                            float(EXPERT_TIMEOUT))
        load.answered(16)  # and serving on after it
    detected = logged_at(cluster.log(attention), "holding the step") - cut
    print(f"\nexpert rank 1's cut link found within {detected:.2f} s "
          f"({len(load.results)} requests)")
    assert detected <= LINK_TIMEOUT + SLACK
    assert_all_answered(load.results, expected)


@demo
def test_a_cut_expert_node_past_the_expert_timeout_is_a_503_naming_the_rank(
        cluster: Cluster) -> None:
    """Node c cut and not back within --expert-timeout (15 s here): the held requests
    fail with a 503 that names expert rank 1 and its address. (A failed expert call aborts
    the step on both DCP ranks: the group stays in step and serves on.)"""
    with cluster.load() as load, cluster.cut(cluster.on("c")):
        line = load.until(r"fail ", LINK_TIMEOUT + float(EXPERT_TIMEOUT) + 30)
    assert re.match(r"fail \d+ 503 ", line), line
    assert "expert rank 1 at switchyard-expert-1.switchyard-expert:7100" in line, line


@demo
def test_a_cut_dcp_rank_breaks_its_group_which_is_recreated_and_loses_no_request(
        cluster: Cluster, expected: list[list[int]]) -> None:
    """The DCP worker's pod (node b) cut from its leader under 8 clients: the group's
    collectives time out (`dcp.group.collective_timeout`: --expert-timeout +
    --link-timeout + 5 s, 24 s here), its leader exits; once the link is back the group is
    recreated whole, as LWS does, and the gateway resubmits its requests: 0 failed."""
    leader, worker = "switchyard-attention-0", "switchyard-attention-0-1"
    bound = float(EXPERT_TIMEOUT) + LINK_TIMEOUT + 5
    with cluster.load() as load:
        with cluster.cut([worker]):
            cut = time.monotonic()
            wait_until(lambda: cluster.procs[leader].poll() is not None, bound + 30,
                       lambda: cluster.log(leader)[-2000:])
            found = time.monotonic() - cut
        cluster.recreate([leader, worker])
        load.answered(16)
    print(f"\nthe DCP group's cut link found within {found:.1f} s (bound {bound:g} s; "
          f"{len(load.results)} requests)")
    assert found <= bound + SLACK
    assert_all_answered(load.results, expected)


@pytest.mark.parametrize("cluster", ["replicas"], indirect=True)
def test_a_cut_expert_node_with_replicas_fails_no_request(
        cluster: Cluster, expected: list[list[int]]) -> None:
    """Node c cut under 8 clients while node b holds a replica of every expert: rank 1 is
    found lost within the link timeout, its experts' tokens go to rank 0, and no request
    fails; every answer is transformers' tokens."""
    attention, lost = "switchyard-attention-0", r"expert rank 1 at \S+ is lost"
    with cluster.load() as load, cluster.cut(cluster.on("c")) as cut:
        cluster.wait_logged(attention, lost, 30)
        load.answered(24)  # served by node b alone
    detected = logged_at(cluster.log(attention), lost) - cut
    print(f"\nexpert rank 1's cut link found within {detected:.2f} s, routed around "
          f"({len(load.results)} requests)")
    assert detected <= LINK_TIMEOUT + SLACK
    assert_all_answered(load.results, expected)


@pytest.mark.parametrize("cluster", ["groups"], indirect=True)
def test_a_cut_link_to_an_attention_group_resubmits_its_requests(
        cluster: Cluster, expected: list[list[int]]) -> None:
    """Attention group 1's pod (node b) cut from the gateway under 8 clients: the gateway
    finds the connection dead within the link timeout and resubmits its requests to group
    0; no request fails, every answer is transformers' tokens."""
    gateway = "switchyard-gateway-0"
    with cluster.load() as load, cluster.cut(["switchyard-attention-1"]) as cut:
        cluster.wait_logged(gateway, "resubmitting", 30)
        load.answered(24)  # served by group 0 alone
    detected = logged_at(cluster.log(gateway), "resubmitting") - cut
    print(f"\nthe gateway's cut link to group 1 found within {detected:.2f} s "
          f"({len(load.results)} requests)")
    assert detected <= LINK_TIMEOUT + SLACK
    assert_all_answered(load.results, expected)


@pytest.mark.parametrize("cluster", ["torch"], indirect=True)
def test_greedy_parity_over_a_gloo_world_across_nodes(
        cluster: Cluster, expected: list[list[int]]) -> None:
    """`--dispatch-backend torch`: the attention rank on node a and the expert ranks on b
    and c, one gloo world that met at `$(LWS_LEADER_ADDRESS)`; greedy token ids equal
    transformers'."""
    served = cluster.client(
        "import json\nfrom tests.support.serving import concurrent_greedy\n"
        f"print(json.dumps(concurrent_greedy('{cluster.url()}', '{DEFAULT_MODEL_NAME}', "
        f"{PROMPTS}, {MAX_TOKENS})))\n")
    assert served == expected
    for pod in ("switchyard-world-0-1", "switchyard-world-0-2"):  # joined as their rank
        rank = int(pod[-1]) - 1
        assert f"expert rank {rank}/2" in cluster.log(pod), cluster.log(pod)[-2000:]
