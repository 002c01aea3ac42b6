"""Fuzz the HTTP API from its own /openapi.json against `switchyard serve` of the demo model.

Over 2,000 requests, valid and invalid: bodies drawn from the request schemas (with
hypothesis-jsonschema), those bodies with one field replaced by any JSON value or removed,
arbitrary JSON documents, garbage and truncated bytes, hostile JSON (deep nesting, huge
numbers) and wrong content types. No request may get a 5xx (nor a streamed error event
with a 5xx code) or go unanswered; afterwards every server process must still run and
the model must still answer correctly.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from switchyard.serve_process import Served
from tests.support import ROOT

pytestmark = pytest.mark.timeout(300)

ENDPOINTS = {  # path -> the request Struct its schema is named after
    "/v1/completions": "CompletionRequest",
    "/v1/chat/completions": "ChatCompletionRequest",
    "/tokenize": "TokenizeRequest",
    "/detokenize": "DetokenizeRequest",
}
VALID_PER_ENDPOINT = {"/v1/completions": 250, "/v1/chat/completions": 250, "/tokenize": 150,
                      "/detokenize": 150}
# Only the *valid* strategy is kept short (the generation length, choices); the invalid
# strategies below still send any value for these fields.
SHORT = {
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
    "max_completion_tokens": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 8},
                                        {"type": "null"}]},
    "n": {"type": "integer", "minimum": 1, "maximum": 2},
}
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": 260}  # in the demo's vocabulary
CONCURRENCY = 16
TIMEOUT_S = 60.0

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)


@dataclass(frozen=True)
class Case:
    """One request to send."""

    kind: str
    path: str
    content: bytes
    content_type: str | None = "application/json"


@dataclass(frozen=True)
class Failure:
    case: Case
    status: int | None
    answer: str

    def __str__(self) -> str:
        return (f"[{self.case.kind}] POST {self.case.path} "
                f"content-type={self.case.content_type!r} body={self.case.content[:400]!r}\n"
                f"  -> {self.status}: {self.answer[:400]}")


def encode(body: object) -> bytes:
    return json.dumps(body).encode()


def draw(strategy: st.SearchStrategy[Any], n: int) -> list[Any]:
    """n examples of `strategy`, the same every run."""
    out: list[Any] = []

    @settings(max_examples=n, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example: Any) -> None:
        out.append(example)

    collect()
    return out


def short_schema(doc: dict[str, Any], name: str, model: str) -> dict[str, Any]:
    """The component `name` with its references inlined, made quick to serve: no unknown
    fields, short strings and lists, token ids near the vocabulary, the served model."""
    schemas = doc["components"]["schemas"]

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            return walk(schemas[node["$ref"].rsplit("/", 1)[1]])
        node = {k: walk(v) for k, v in node.items() if k not in ("title", "description")}
        kind = node.get("type")
        if kind == "object":
            node.setdefault("additionalProperties", False)
            props = node.get("properties", {})
            props.update({k: v for k, v in SHORT.items() if k in props})
            if "model" in props:
                props["model"] = {"enum": [model, None]}
            if "max_tokens" in props:
                node["required"] = sorted({*node.get("required", []), "max_tokens"})
        elif kind == "string":
            node.setdefault("maxLength", 24)
        elif kind == "array":
            node.setdefault("maxItems", 8)
            if node.get("items") == {"type": "integer", "minimum": 0}:
                node["items"] = TOKEN_ID
        return node

    return walk(schemas[name])


def strategy_of(node: Any) -> st.SearchStrategy[Any]:
    """What `from_schema(node)` draws, with closed objects, unions and lists taken apart here:
    hypothesis-jsonschema builds an object's member strategies again on every draw, which
    made drawing the valid bodies most of this test's time."""
    if isinstance(node, dict) and set(node) <= {"anyOf", "default"} and "anyOf" in node:
        return st.one_of([strategy_of(branch) for branch in node["anyOf"]])
    if isinstance(node, dict) and node.get("additionalProperties") is False \
            and set(node) == {"type", "properties", "required", "additionalProperties"}:
        required = set(node["required"])
        members = {k: strategy_of(v) for k, v in node["properties"].items()}
        return st.fixed_dictionaries({k: v for k, v in members.items() if k in required},
                                     optional={k: v for k, v in members.items()
                                               if k not in required})
    if isinstance(node, dict) and node.get("type") == "array" \
            and set(node) <= {"type", "items", "minItems", "maxItems"}:
        return st.lists(strategy_of(node["items"]), min_size=node.get("minItems", 0),
                        max_size=node["maxItems"])
    return from_schema(node)


def hostile_bodies() -> list[bytes]:
    """JSON that parsers trip over, and bodies of the wrong JSON type."""
    return [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
            b'{"max_tokens": 1e999}', b'{"max_tokens": ' + b"9" * 5000 + b"}",
            b'{"prompt": "\xff\xfe"}', b'{"prompt": "\\ud800"}', b'{"prompt": NaN}', b"",
            b"null", b'"text"', b"[]", b"123", b"{}", b'{"prompt": "a"}{"prompt": "b"}',
            b'{"prompt": "a", "prompt": [1]}', b"\x00" * 64]


def build_cases(doc: dict[str, Any], model: str) -> list[Case]:
    """`draw_cases`, in a fresh interpreter: Hypothesis's draws, derandomized, still depend
    on what other tests drew before in the same process (run after two other modules'
    property tests, 70 generations were accepted instead of 120), and the cases must be
    the same every run."""
    code = ("import base64, json, sys\n"
            "from tests.e2e.test_fuzz import draw_cases\n"
            "doc, model = json.load(sys.stdin)\n"
            "json.dump([[c.kind, c.path, base64.b64encode(c.content).decode(), c.content_type]"
            " for c in draw_cases(doc, model)], sys.stdout)\n")
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps([doc, model]),
                         capture_output=True, text=True, timeout=240, cwd=ROOT, check=True)
    return [Case(kind, path, base64.b64decode(content), content_type)
            for kind, path, content, content_type in json.loads(out.stdout)]


def draw_cases(doc: dict[str, Any], model: str) -> list[Case]:
    valid: dict[str, list[dict[str, Any]]] = {
        path: draw(strategy_of(short_schema(doc, name, model)), VALID_PER_ENDPOINT[path])
        for path, name in ENDPOINTS.items()
    }
    cases = [Case("valid", path, encode(body)) for path, bodies in valid.items()
             for body in bodies]
    properties = {path: [*doc["components"]["schemas"][name]["properties"], "unknown"]
                  for path, name in ENDPOINTS.items()}
    paths = st.sampled_from(list(ENDPOINTS))

    @st.composite
    def mutated(draw_: st.DrawFn) -> Case:
        path = draw_(paths)
        body = dict(draw_(st.sampled_from(valid[path])))
        field = draw_(st.sampled_from(properties[path]))
        if draw_(st.integers(0, 9)) == 0:
            body.pop(field, None)
        else:
            body[field] = draw_(JSON_VALUES)
        return Case("mutated", path, encode(body))

    @st.composite
    def garbage(draw_: st.DrawFn) -> Case:
        path = draw_(paths)
        if draw_(st.booleans()):
            return Case("garbage", path, draw_(st.binary(max_size=200)))
        whole = encode(draw_(st.sampled_from(valid[path])))
        return Case("truncated", path, whole[: draw_(st.integers(0, len(whole) - 1))])

    @st.composite
    def content_types(draw_: st.DrawFn) -> Case:
        path = draw_(paths)
        body = encode(draw_(st.sampled_from(valid[path])))
        kind = draw_(st.sampled_from([None, "text/plain", "application/x-www-form-urlencoded",
                                      "multipart/form-data; boundary=x", "application/xml"]))
        return Case("content-type", path, body, kind)

    cases += draw(mutated(), 650)
    cases += [Case("any-json", path, encode(value))
              for path, value in draw(st.tuples(paths, JSON_VALUES), 300)]
    cases += draw(garbage(), 250)
    cases += draw(content_types(), 100)
    cases += [Case("hostile", path, body) for path in ENDPOINTS for body in hostile_bodies()]
    return cases


async def send(client: httpx.AsyncClient, case: Case
               ) -> tuple[int, Failure | None, str]:
    headers = {"content-type": case.content_type} if case.content_type else {}
    try:
        async with client.stream("POST", case.path, content=case.content,
                                 headers=headers) as r:
            answer = (await r.aread()).decode(errors="replace")
    except httpx.HTTPError as exc:
        return 0, Failure(case, None, f"no answer: {exc!r}"), ""
    if r.status_code >= 500:
        return r.status_code, Failure(case, r.status_code, answer), answer
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in answer.split("\n\n") if e]
        if not events or events[-1] != "[DONE]":
            failure = Failure(case, r.status_code, f"unfinished stream: {answer}")
            return r.status_code, failure, answer
        for e in events[:-1]:
            try:
                code = json.loads(e).get("error", {}).get("code", 0)
            except (ValueError, AttributeError):
                return r.status_code, Failure(case, r.status_code, f"malformed event: {e}"), answer
            if code >= 500:
                return r.status_code, Failure(case, r.status_code, f"streamed error: {e}"), answer
    return r.status_code, None, answer


async def send_all(url: str, cases: list[Case]
                   ) -> tuple[list[tuple[Case, int]], list[Failure], list[str]]:
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits) as client:
        async def one(case: Case) -> tuple[int, Failure | None, str]:
            async with gate:
                return await send(client, case)

        results = await asyncio.gather(*(one(c) for c in cases))
    statuses = [(case, status) for case, (status, _, _) in zip(cases, results, strict=True)]
    return statuses, [f for _, f, _ in results if f is not None], [a for _, _, a in results]


def test_fuzz_never_5xx_and_the_server_survives(served_demo: Served) -> None:
    # the default topology: gateway, attention, 2 expert services (tests/e2e/conftest.py)
    doc = httpx.get(f"{served_demo.url}/openapi.json").json()
    model = httpx.get(f"{served_demo.url}/v1/models").json()["data"][0]["id"]
    cases = build_cases(doc, model)
    assert len(cases) >= 2000

    statuses, failures, answers = asyncio.run(send_all(served_demo.url, cases))

    print(Counter((c.kind, s) for c, s in statuses))  # what the run covered (pytest -s)
    report = "\n".join(str(f) for f in failures[:40])
    assert not failures, f"{len(failures)} of {len(cases)} requests failed:\n{report}\n" \
                         f"server log tail:\n{served_demo.stderr()[-3000:]}"
    generated = sum(s == 200 for c, s in statuses if c.path.startswith("/v1/"))
    refused = Counter(answer[:120] for (c, s), answer in zip(statuses, answers, strict=True)
                      if c.kind == "valid" and c.path.startswith("/v1/") and s == 400)
    assert generated >= 100, "too few generation requests were accepted to mean anything: " \
        f"{generated}; the valid ones refused, by answer: {refused.most_common(8)}"
    assert served_demo.proc.poll() is None and all(served_demo.children_alive())
    r = httpx.post(f"{served_demo.url}/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "What is 123 + 456?"}],
        "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "579"
