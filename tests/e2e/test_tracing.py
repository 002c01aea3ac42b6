"""One request through `switchyard serve` (gateway, attention, 2 expert services) is one
trace: spans from every service, parented or linked, with the GenAI and per-expert
attributes. Each process keeps its spans in the SDK's in-memory exporter and writes them
out when it exits (SWITCHYARD_TRACES_DUMP_DIR)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from switchyard.serve_process import Served
from tests.support.engines import prompts

pytestmark = pytest.mark.timeout(300)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def read_spans(directory: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(directory.glob("*.jsonl"))
            for line in f.read_text().splitlines()]


def test_one_request_is_one_trace_across_every_service(qwen3_ckpt: tuple,
                                                       tmp_path: Path) -> None:
    path, _ = qwen3_ckpt
    env = {"SWITCHYARD_TRACES_DUMP_DIR": str(tmp_path)}
    with Served(["--model", str(path), "--expert-services", "2"], env=env) as served:
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        r = httpx.post(f"{served.url}/v1/completions", timeout=60,
                       headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
                       json={"model": name, "prompt": prompts(seed=61, lengths=(9,))[0],
                             "max_tokens": 5, "temperature": 0.7, "top_p": 0.9,
                             "ignore_eos": True})
        assert r.status_code == 200
        response_id = r.json()["id"]
    spans = read_spans(tmp_path)  # the services wrote them as they exited
    by_id = {s["context"]["span_id"]: s for s in spans}
    services = {s["resource"]["attributes"]["service.name"] for s in spans}
    assert services == {"switchyard-gateway", "switchyard-attention", "switchyard-expert"}

    [request] = [s for s in spans if s["name"] == f"text_completion {name}"]
    assert request["context"]["trace_id"] == f"0x{TRACE_ID}"  # continues the client's trace
    assert request["parent_id"] == f"0x{CLIENT_SPAN}"
    attrs = request["attributes"]
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == name
    assert attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.request.temperature"] == 0.7
    assert attrs["gen_ai.request.top_p"] == 0.9
    assert attrs["gen_ai.usage.input_tokens"] == 9
    assert attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.response.id"] == response_id
    assert attrs["switchyard.time_to_first_token_s"] > 0

    # The attention service's phases are children of the request span.
    phases = {s["name"]: s for s in spans if s["parent_id"] == request["context"]["span_id"]}
    assert set(phases) == {"queue", "prefill", "decode"}
    assert phases["decode"]["attributes"]["switchyard.output_tokens"] == 5

    # Every step that served the request links to it; its layers' dispatch spans are the
    # parents of the expert services' layer spans, whose children are the experts.
    steps = [s for s in spans if s["name"] == "step"
             and any(link["context"]["span_id"] == request["context"]["span_id"]
                     for link in s["links"])]
    assert len(steps) == 5  # one prefill step and four decode steps
    step_ids = {s["context"]["span_id"] for s in steps}
    dispatches = {s["context"]["span_id"]: s for s in spans
                  if s["name"].startswith("dispatch layer") and s["parent_id"] in step_ids}
    expert_layers = [s for s in spans if s["name"].startswith("experts layer")
                     and s["parent_id"] in dispatches]
    assert expert_layers
    assert {s["attributes"]["switchyard.expert_rank"] for s in expert_layers} == {0, 1}
    experts = [s for s in spans if s["name"].startswith("expert ")
               and by_id.get(s["parent_id"], {}).get("name", "").startswith("experts layer")]
    assert experts
    for s in experts:
        a = s["attributes"]
        assert {"switchyard.layer", "switchyard.expert", "switchyard.expert_rank",
                "switchyard.tokens", "switchyard.duration_s"} <= set(a)
        assert a["switchyard.tokens"] >= 1 and a["switchyard.duration_s"] >= 0
    # A step serves many requests, so it roots its own trace (linked to theirs); the expert
    # services' spans are in the step's trace, across the process boundary.
    step_traces = {s["context"]["trace_id"] for s in steps}
    assert {s["context"]["trace_id"] for s in expert_layers} <= step_traces


def test_only_sampled_requests_are_traced(qwen3_ckpt: tuple, tmp_path: Path) -> None:
    """With a sampler that samples no new root, a request whose client sampled it is traced
    in the gateway and the attention service, with every step that served it (steps follow
    their links), but without per-layer or per-expert detail (the sampler did not pick
    those steps); a request nobody sampled leaves no span anywhere, and neither do steps
    that served only it."""
    path, _ = qwen3_ckpt
    env = {"SWITCHYARD_TRACES_DUMP_DIR": str(tmp_path),
           "OTEL_TRACES_SAMPLER": "parentbased_always_off"}
    with Served(["--model", str(path), "--expert-services", "2"], env=env) as served:
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        [sampled, unsampled] = prompts(seed=62, lengths=(6, 7))
        for prompt, headers in ((unsampled, {}),
                                (sampled, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}),
                                (unsampled, {"traceparent": f"00-{'1' * 32}-{'2' * 16}-00"})):
            r = httpx.post(f"{served.url}/v1/completions", timeout=60, headers=headers,
                           json={"model": name, "prompt": prompt, "max_tokens": 3,
                                 "ignore_eos": True})
            assert r.status_code == 200
    spans = read_spans(tmp_path)
    [request] = [s for s in spans if s["name"] == f"text_completion {name}"]
    assert request["context"]["trace_id"] == f"0x{TRACE_ID}"
    phases = [s for s in spans if s["parent_id"] == request["context"]["span_id"]]
    assert sorted(s["name"] for s in phases) == ["decode", "prefill", "queue"]
    steps = [s for s in spans if s["name"] == "step"]
    assert len(steps) == 3  # prefill and two decode steps of the sampled request, no others
    assert all([link["context"]["span_id"] for link in s["links"]]
               == [request["context"]["span_id"]] for s in steps)
    assert all(s["attributes"]["switchyard.detail"] is False for s in steps)
    assert {s["name"] for s in spans} == {f"text_completion {name}", "queue", "prefill",
                                          "decode", "step"}
    step_traces = {s["context"]["trace_id"] for s in steps}
    assert {s["context"]["trace_id"] for s in spans} == step_traces | {f"0x{TRACE_ID}"}


STEP_OF_300 = """
import random
from opentelemetry.trace import SpanContext, TraceFlags
from services.attention.scheduler import ScheduledSeq
from services.attention.sequence import Sequence
from services.attention.tracing import step_span
from common import tracing
from common.messages import SamplingParams

tracing.setup_tracing("attention")
rng = random.Random(0)
parents = [SpanContext(rng.getrandbits(128), rng.getrandbits(64), True,
                       TraceFlags(TraceFlags.SAMPLED)) for _ in range(300)]
seqs = [Sequence(f"r{i}", [1], 1, SamplingParams(), trace_parent=p)
        for i, p in enumerate(parents + parents[:5])]  # 5 requests with a 2nd choice
with step_span([ScheduledSeq(s, 1) for s in seqs]):
    pass
tracing.shutdown()
"""


def test_a_step_links_every_request_it_serves_once(tmp_path: Path) -> None:
    """300 sampled requests in one step (the OpenTelemetry SDK keeps 128 links by
    default), 5 of them with a second choice: 300 links, one per request span."""
    env = {**os.environ, "SWITCHYARD_TRACES_DUMP_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", STEP_OF_300], env=env, check=True, timeout=120)
    [step] = [s for s in read_spans(tmp_path) if s["name"] == "step"]
    links = [link["context"]["span_id"] for link in step["links"]]
    assert len(links) == len(set(links)) == 300


def test_a_pipelined_step_shows_each_micro_batch(qwen3_ckpt: tuple, tmp_path: Path) -> None:
    """`--micro-batches 2`: a step of a request's two choices has one `micro-batch j`
    child per micro-batch, each with its `attention layer l` and `exchange layer l`
    intervals in turn; micro-batch 1's attention for layer l starts inside micro-batch
    0's exchange of layer l, as a tracing UI draws it."""
    path, _ = qwen3_ckpt
    env = {"SWITCHYARD_TRACES_DUMP_DIR": str(tmp_path)}
    with Served(["--model", str(path), "--expert-services", "2", "--micro-batches", "2"],
                env=env) as served:
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        r = httpx.post(f"{served.url}/v1/completions", timeout=60,
                       json={"model": name, "prompt": prompts(seed=63, lengths=(7,))[0],
                             "max_tokens": 3, "n": 2, "ignore_eos": True})
        assert r.status_code == 200
    spans = read_spans(tmp_path)
    children: dict[str, list[dict]] = {}
    for s in spans:
        children.setdefault(s["parent_id"], []).append(s)
    steps = [s for s in spans if s["name"] == "step"  # the choices' decode steps
             and s["attributes"]["switchyard.sequences"] == 2
             and s["attributes"]["switchyard.tokens"] == 2]
    assert steps, [s["attributes"] for s in spans if s["name"] == "step"]
    layers = sorted({s["attributes"]["switchyard.layer"] for s in spans
                     if s["name"].startswith("experts layer")})
    for step in steps:
        micro = {s["name"]: s for s in children[step["context"]["span_id"]]
                 if s["name"].startswith("micro-batch")}
        assert set(micro) == {"micro-batch 0", "micro-batch 1"}, \
            [s["name"] for s in children[step["context"]["span_id"]]]
        parts = {j: {s["name"]: s for s in children[micro[f"micro-batch {j}"]["context"]
                                                      ["span_id"]]} for j in (0, 1)}
        for j in (0, 1):
            want = [f"{kind} layer {layer}" for layer in layers
                    for kind in ("attention", "exchange")] + ["attention final"]
            assert sorted(parts[j], key=lambda n: parts[j][n]["start_time"]) == want, \
                {n: (p["start_time"], p["end_time"]) for n, p in parts[j].items()}
        for layer in layers:
            exchange = parts[0][f"exchange layer {layer}"]
            starts = parts[1][f"attention layer {layer}"]["start_time"]
            assert exchange["start_time"] <= starts < exchange["end_time"]
