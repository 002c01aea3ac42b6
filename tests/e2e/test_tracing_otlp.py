"""Tracing into a real receiver: `switchyard serve --otlp-traces-endpoint` exports over
OTLP/HTTP to Arize Phoenix, started here, and the spans are read back through Phoenix's
own REST API: one request's trace across the gateway and the attention service, the
steps' traces down to each expert on both expert services, and an expert rebalance's.

Phoenix drops span links and resource attributes on ingest, so the links from steps to
requests and the service names are checked in tests/e2e/test_tracing.py instead."""

from __future__ import annotations

import httpx
import pytest

from switchyard.serve_process import Served
from tests.support.engines import prompts
from tests.support.tools import phoenix, wait_until

pytestmark = pytest.mark.timeout(400)
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def test_spans_reach_a_real_otlp_receiver(qwen3_ckpt: tuple) -> None:
    path, _ = qwen3_ckpt
    with phoenix() as receiver:
        flags = ["--model", str(path), "--expert-services", "2", "--enable-eplb",
                 "--eplb-interval", "0", "--otlp-traces-endpoint", receiver.traces_url]
        with Served(flags, env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as served:
            name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
            r = httpx.post(f"{served.url}/v1/completions", timeout=60,
                           headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"},
                           json={"model": name, "prompt": prompts(seed=91, lengths=(8,))[0],
                                 "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
            moved = httpx.post(f"{served.url}/eplb/rebalance", timeout=60)
            assert moved.status_code == 200, moved.text

            def arrived() -> list[dict] | None:
                """Every span once the request's are in and each expert span's ancestors
                too (batches from different processes arrive in any order)."""
                spans = receiver.spans()
                ids = {s["context"]["span_id"]: s for s in spans}
                experts = [s for s in spans if s["name"].startswith("expert ")]

                def rooted(s: dict) -> bool:
                    while s["parent_id"] is not None:
                        if s["parent_id"] not in ids:
                            return False
                        s = ids[s["parent_id"]]
                    return True

                names = {s["name"] for s in spans}
                done = {"decode", f"text_completion {name}", "eplb rebalance"} <= names and \
                    experts and \
                    all(rooted(s) for s in experts)
                return spans if done else None

            spans = wait_until(arrived, 60, lambda: "the request's spans in Phoenix")

    by_id = {s["context"]["span_id"]: s for s in spans}
    [request] = [s for s in spans if s["name"] == f"text_completion {name}"]
    assert request["context"]["trace_id"] == TRACE_ID
    assert request["parent_id"] == CLIENT_SPAN
    attrs = request["attributes"]
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == name
    assert attrs["gen_ai.usage.input_tokens"] == 8
    assert attrs["gen_ai.usage.output_tokens"] == 4
    assert attrs["gen_ai.response.id"] == r.json()["id"]

    # The attention service's phases continue the same trace, under the request span.
    phases = {s["name"] for s in spans if s["parent_id"] == request["context"]["span_id"]}
    assert phases == {"queue", "prefill", "decode"}

    # Steps are roots of their own traces; inside each, the attention service's dispatch
    # spans parent the expert services' layer spans, and those the per-expert spans.
    steps = [s for s in spans if s["name"] == "step"]
    assert len(steps) >= 4 and all(s["parent_id"] is None for s in steps)
    experts = [s for s in spans if s["name"].startswith("expert ")]
    ranks = set()
    for span in experts:
        layer = by_id[span["parent_id"]]
        dispatch = by_id[layer["parent_id"]]
        step = by_id[dispatch["parent_id"]]
        assert layer["name"].startswith("experts layer")
        assert dispatch["name"] == layer["name"].replace("experts", "dispatch")
        assert step["name"] == "step"
        assert span["context"]["trace_id"] == step["context"]["trace_id"]
        a = span["attributes"]
        assert span["name"] == f"expert {a['switchyard.layer']}.{a['switchyard.expert']}"
        assert a["switchyard.tokens"] > 0 and a["switchyard.duration_s"] > 0
        ranks.add(a["switchyard.expert_rank"])
    assert ranks == {0, 1}

    # The expert rebalance is a span of its own, with what it moved.
    [rebalance] = [s for s in spans if s["name"] == "eplb rebalance"]
    record = moved.json()["rebalance"]
    attrs = rebalance["attributes"]
    assert attrs["switchyard.placement_version"] == record["version"] == 1
    assert attrs["switchyard.moved_copies"] == record["moved"] > 0
    assert attrs["switchyard.trigger"] == "request"
    assert attrs["switchyard.load_s"] == record["load_s"]
