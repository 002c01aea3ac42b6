"""/tokenize and /detokenize in-process against the app (no engine): text, chat templates,
special tokens and errors (through HTTP: tests/e2e/test_endpoints.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import tokenizers
from transformers import AutoTokenizer

from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.routing.engine_pool import EnginePool
from gateway.text.tokenizer import Tokenizer
from tests.support.gateway import CHAT, error_of, write_checkpoint

pytestmark = pytest.mark.timeout(120)



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

















