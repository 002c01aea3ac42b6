"""/tokenize, /detokenize, /version and /openapi.json through HTTP against `switchyard serve`
of the demo model: round trips, and the OpenAPI document against real responses."""

from __future__ import annotations

import json
from importlib.metadata import version
from typing import Any

import httpx
import jsonschema
import pytest
import tokenizers
from transformers import AutoTokenizer

from switchyard.demo_model import DEFAULT_MODEL
from switchyard.serve_process import Served
from tests.support.gateway import CHAT, error_of

pytestmark = pytest.mark.timeout(120)





@pytest.fixture(scope="module")
def demo(served_demo_local: Served) -> Served:
    """`--dispatch-backend local`: the session's server (tests/e2e/conftest.py)."""
    return served_demo_local


@pytest.fixture(scope="module")
def openapi(demo: Served) -> dict[str, Any]:
    r = httpx.get(f"{demo.url}/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return json.loads(r.content)


def validator(doc: dict[str, Any], name: str) -> jsonschema.Draft202012Validator:
    """A validator for one component, its references resolved within the document."""
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


def check(doc: dict[str, Any], name: str, instance: object) -> None:
    errors = [e.message for e in validator(doc, name).iter_errors(instance)]
    assert not errors, (name, instance, errors)


def test_tokenize_detokenize_round_trip(demo: Served, openapi: dict[str, Any]) -> None:
    backend = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    text = "What is 900 - 937? Grüße 🚀"
    request = {"model": "switchyard-arith-moe", "prompt": text}
    check(openapi, "TokenizeRequest", request)
    r = httpx.post(f"{demo.url}/tokenize", json=request)
    assert r.status_code == 200, r.text
    body = r.json()
    check(openapi, "TokenizeResponse", body)
    assert body["tokens"] == backend.encode(text).ids and body["count"] == len(body["tokens"])
    models = httpx.get(f"{demo.url}/v1/models").json()
    assert body["max_model_len"] == models["data"][0]["max_model_len"] == 128
    r = httpx.post(f"{demo.url}/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200, r.text
    check(openapi, "DetokenizeResponse", r.json())
    assert r.json() == {"prompt": text}
    assert httpx.post(f"{demo.url}/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    vocab_size = backend.get_vocab_size()
    error_of(httpx.post(f"{demo.url}/detokenize", json={"tokens": [5, vocab_size]}), 400,
             "tokens")


def test_tokenize_chat_counts_what_chat_completions_send(demo: Served,
                                                         openapi: dict[str, Any]) -> None:
    hf = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))  # the reference
    r = httpx.post(f"{demo.url}/tokenize", json={"messages": CHAT})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert tokens == hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    request = {"messages": CHAT, "max_tokens": 8, "temperature": 0}
    check(openapi, "ChatCompletionRequest", request)
    chat = httpx.post(f"{demo.url}/v1/chat/completions", json=request, timeout=60)
    assert chat.status_code == 200, chat.text
    check(openapi, "ChatCompletion", chat.json())
    assert chat.json()["usage"]["prompt_tokens"] == len(tokens)
    assert chat.json()["choices"][0]["message"]["content"] == "579"
    # Special tokens come back as text, so the rendered prompt round-trips.
    r = httpx.post(f"{demo.url}/detokenize", json={"tokens": tokens})
    assert r.json()["prompt"] == hf.apply_chat_template(CHAT, add_generation_prompt=True,
                                                        tokenize=False)


def test_version(demo: Served, openapi: dict[str, Any]) -> None:
    r = httpx.get(f"{demo.url}/version")
    assert r.status_code == 200
    check(openapi, "VersionResponse", r.json())
    assert r.json() == {"version": version("switchyard")} == {"version": openapi["info"]["version"]}


def test_openapi_document_is_complete_and_resolves(openapi: dict[str, Any]) -> None:
    assert openapi["openapi"].startswith("3.1")
    assert {p: m for p, m in PATHS.items() if m in openapi["paths"].get(p, {})} == PATHS
    schemas = openapi["components"]["schemas"]
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    refs: list[str] = []

    def collect(node: object) -> None:
        if isinstance(node, dict):
            refs.extend(v for k, v in node.items() if k == "$ref")
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    collect(openapi)
    assert refs and all(r.startswith("#/components/schemas/") for r in refs)
    assert {r.rsplit("/", 1)[1] for r in refs} <= set(schemas)
    for path, method in PATHS.items():
        op = openapi["paths"][path][method]
        assert "200" in op["responses"], path
        if method == "post":
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            validator(openapi, ref.rsplit("/", 1)[1])  # resolves
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = openapi["paths"][path]["post"]["responses"]
        assert {"400", "404", "413", "429", "503"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/ErrorBody")
    assert "text/plain" in openapi["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    # Fields are taken from the request Structs themselves.
    chat = schemas["ChatCompletionRequest"]
    assert {"messages", "max_tokens", "temperature", "stream"} <= set(chat["properties"])
    assert chat["required"] == ["messages"]


def test_openapi_schemas_match_real_responses(demo: Served, openapi: dict[str, Any]) -> None:
    check(openapi, "ModelList", httpx.get(f"{demo.url}/v1/models").json())
    request = {"prompt": [87, 104, 97, 116], "max_tokens": 3, "return_token_ids": True}
    check(openapi, "CompletionRequest", request)
    r = httpx.post(f"{demo.url}/v1/completions", json=request, timeout=60)
    check(openapi, "Completion", r.json())
    stream = {"messages": CHAT, "max_tokens": 8, "stream": True,
              "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{demo.url}/v1/chat/completions", json=stream,
                      timeout=60) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]" and len(events) >= 3  # chunks, then the usage chunk
    for e in events[:-1]:
        check(openapi, "ChatCompletionChunk", json.loads(e))
    error = httpx.post(f"{demo.url}/v1/completions", json={"model": "nope", "prompt": "a"})
    assert error.status_code == 404
    check(openapi, "ErrorBody", error.json())


PATHS = {
    "/v1/completions": "post", "/v1/chat/completions": "post", "/v1/models": "get",
    "/tokenize": "post", "/detokenize": "post", "/health": "get", "/version": "get",
    "/metrics": "get",
}
