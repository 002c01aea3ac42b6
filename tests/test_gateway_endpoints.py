"""/tokenize, /detokenize, /version and /openapi.json: in-process against the app (no
engine), and through HTTP against `switchyard serve` of the bundled demo model."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import tokenizers
from transformers import AutoTokenizer

from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.engine_pool import EnginePool
from gateway.tokenizer import Tokenizer
from switchyard.demo_model import DEFAULT_MODEL
from switchyard.serve_process import Served
from tests.test_gateway_support import write_checkpoint

pytestmark = pytest.mark.timeout(120)

CHAT = [{"role": "user", "content": "What is 123 + 456?"}]
PATHS = {
    "/v1/completions": "post", "/v1/chat/completions": "post", "/v1/models": "get",
    "/tokenize": "post", "/detokenize": "post", "/health": "get", "/version": "get",
    "/metrics": "get",
}


def error_of(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# In-process: the app without its lifespan, so the engine never connects.

@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-style tokenizer that prepends <s> when asked for special tokens."""
    return write_checkpoint(tmp_path_factory.mktemp("tok") / "bos-model", add_bos=True)


async def app_client(model_dir: Path, with_tokenizer: bool = True,
                     max_model_len: int | None = None) -> httpx.AsyncClient:
    config = GatewayConfig(model_dir=model_dir, served_model_name=model_dir.name,
                           engines=(("127.0.0.1", 9),), max_model_len=max_model_len)
    app = build_app(config, EnginePool(list(config.engines)),
                    Tokenizer.load(model_dir) if with_tokenizer else None)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


@pytest.fixture
async def offline(bos_model: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with await app_client(bos_model, max_model_len=100) as client:
        yield client


@pytest.mark.anyio
async def test_tokenize_text_and_special_tokens(offline: httpx.AsyncClient,
                                                bos_model: Path) -> None:
    backend = tokenizers.Tokenizer.from_file(str(bos_model / "tokenizer.json"))
    text = "Grüße, naïve café 🚀"
    r = await offline.post("/tokenize", json={"model": "bos-model", "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = backend.encode(text).ids
    assert ids[0] == backend.token_to_id("<s>")  # added, as the default asks
    assert body == {"count": len(ids), "max_model_len": 100, "tokens": ids, "token_strs": None}
    r = await offline.post("/tokenize", json={"prompt": text, "add_special_tokens": False,
                                              "return_token_strs": True})
    plain = backend.encode(text, add_special_tokens=False)
    assert r.json()["tokens"] == plain.ids and r.json()["token_strs"] == plain.tokens


@pytest.mark.anyio
async def test_tokenize_chat_uses_the_chat_template(offline: httpx.AsyncClient,
                                                    bos_model: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(bos_model))  # the reference
    parts = [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "world!"}]
    r = await offline.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 200, r.text
    # Text parts are joined by newlines and no BOS is added, exactly as chat completions do.
    expected = hf.apply_chat_template([{"role": "user", "content": "Hello,\nworld!"}],
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)
    r = await offline.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True})
    rendered = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert r.json()["tokens"] == hf.encode(rendered, add_special_tokens=True)
    r = await offline.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False})
    assert r.json()["tokens"] == hf.apply_chat_template(
        CHAT, add_generation_prompt=False, tokenize=True, return_dict=False)


@pytest.mark.anyio
async def test_tokenization_errors(offline: httpx.AsyncClient) -> None:
    error_of(await offline.post("/tokenize", json={}), 400, "prompt")
    error_of(await offline.post("/tokenize", json={"prompt": "a", "messages": CHAT}), 400,
             "prompt")
    error_of(await offline.post("/tokenize", json={"prompt": 3}), 400, "prompt")
    error_of(await offline.post("/tokenize", json={"messages": []}), 400, "messages")
    error_of(await offline.post("/tokenize", json={
        "messages": CHAT, "chat_template_kwargs": {"tokenize": False}}), 400)
    error_of(await offline.post("/tokenize", content=b'{"prompt": "a"',
                                headers={"content-type": "application/json"}), 400)
    error_of(await offline.post("/tokenize", json={"model": "other", "prompt": "a"}), 404,
             "model")
    error_of(await offline.post("/detokenize", json={"tokens": [1, -2]}), 400, "tokens")
    error_of(await offline.post("/detokenize", json={"tokens": "1 2"}), 400, "tokens")
    error_of(await offline.post("/detokenize", json={"model": "other", "tokens": [1]}), 404)
    # Out-of-vocabulary ids need the engine's vocabulary size: not connected here.
    error_of(await offline.post("/detokenize", json={"tokens": [1]}), 503)
    error_of(await offline.get("/tokenize"), 405)


@pytest.mark.anyio
async def test_without_a_tokenizer_tokenization_is_a_400(bos_model: Path) -> None:
    async with await app_client(bos_model, with_tokenizer=False) as client:
        for path, body in [("/tokenize", {"prompt": "a"}), ("/tokenize", {"messages": CHAT}),
                           ("/detokenize", {"tokens": [1]})]:
            assert "tokenizer" in error_of(await client.post(path, json=body), 400)["message"]


# Through HTTP: the bundled demo model, one engine process.

@pytest.fixture(scope="module")
def demo() -> Iterator[Served]:
    with Served(["--dispatch-backend", "local"]) as served:
        yield served


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
