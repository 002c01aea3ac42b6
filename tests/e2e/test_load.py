"""Clients that leave and clients that flood: aborts free the engine, overload gets 429,
and the gateway keeps answering. Real processes on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from switchyard.serve_process import Served
from tests.support.engines import prompts

pytestmark = pytest.mark.timeout(300)
LONG = 400  # tokens: long enough that dropped streams are still generating


def _body(model: str, prompt: list[int], stream: bool) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}


async def _stream_tokens(http: httpx.AsyncClient, body: dict, keep: int | None) -> list[int]:
    """Token ids of a streamed completion; with `keep`, hang up after that many chunks."""
    tokens: list[int] = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                tokens += [t for c in choices for t in c.get("token_ids") or []]
                chunks += 1
                if keep is not None and chunks >= keep:
                    return tokens  # leaving the block closes the connection mid-stream
    return tokens


@pytest.fixture(scope="module")
def tiny(qwen3_ckpt: tuple) -> Iterator[tuple[Served, str]]:
    path, _ = qwen3_ckpt
    with Served(["--model", str(path)]) as served:
        yield served, httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]


def test_dropped_streams_are_aborted_and_free_their_blocks(tiny: tuple) -> None:
    served, model = tiny
    ps = prompts(seed=31, lengths=(5, 9, 13, 7, 11, 6, 8, 10))

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as http:
            whole = await asyncio.gather(*(http.post("/v1/completions",
                                                     json=_body(model, p, False))
                                           for p in ps[::2]))
            expected = [r.json()["choices"][0]["token_ids"] for r in whole]
            got = await asyncio.gather(*(_stream_tokens(http, _body(model, p, True),
                                                        None if i % 2 == 0 else 3)
                                         for i, p in enumerate(ps)))
            return expected, got

    before = httpx.get(f"{served.url}/stats").json()["num_aborted"]
    expected, got = asyncio.run(run())
    assert got[::2] == expected  # the four that stayed got everything
    assert all(len(t) == LONG for t in expected)
    assert all(len(t) < LONG for t in got[1::2])
    stats = httpx.get(f"{served.url}/stats").json()
    assert stats["num_aborted"] - before == 4
    assert stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0
    metrics = httpx.get(f"{served.url}/metrics").text
    aborted = [ln for ln in metrics.splitlines()
               if ln.startswith("switchyard:request_success_total")
               and 'finished_reason="abort"' in ln]
    assert aborted and float(aborted[0].split()[-1]) == 4


def test_overload_gets_429_fast_while_accepted_requests_finish_and_health_answers(
        qwen3_ckpt: tuple) -> None:
    path: Path = qwen3_ckpt[0]
    # Two run at once and two may wait: 4 places; the rest of a 40-request flood is refused.
    env = {"SWITCHYARD_RETRY_AFTER": "3"}  # a gateway-only flag, set from the environment
    with Served(["--model", str(path), "--max-num-seqs", "2", "--max-queued-requests", "2"],
                env=env) as served:
        model = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        ps = prompts(seed=41, lengths=(6,) * 40)

        async def one(http: httpx.AsyncClient, p: list[int]) -> tuple[int, float, dict]:
            r = await http.post("/v1/completions", json=_body(model, p, False))
            return r.status_code, time.monotonic(), {**r.json(), "headers": r.headers}

        async def health(http: httpx.AsyncClient, done: asyncio.Event) -> list[int]:
            codes = []
            while not done.is_set():
                codes.append((await http.get("/health", timeout=5)).status_code)
                await asyncio.sleep(0.05)
            return codes

        async def run() -> tuple[list, list[int]]:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=served.url, timeout=120,
                                         limits=limits) as http:
                done = asyncio.Event()
                probe = asyncio.create_task(health(http, done))
                results = await asyncio.gather(*(one(http, p) for p in ps))
                done.set()
                return results, await probe

        results, health_codes = asyncio.run(run())
        accepted = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 429]
        assert len(accepted) == 4 and len(refused) == 36, [r[0] for r in results]
        assert all(len(r[2]["choices"][0]["token_ids"]) == LONG for r in accepted)
        first_done = min(t for _, t, _ in accepted)
        assert all(t < first_done for _, t, _ in refused)  # refused before any finished
        assert all(r[2]["headers"]["retry-after"] == "3" for r in refused)
        assert refused[0][2]["error"]["code"] == 429
        assert health_codes and set(health_codes) == {200}
        assert all(served.children_alive())
        # Once the flood is over, the places are free again.
        r = httpx.post(f"{served.url}/v1/completions", timeout=60,
                       json={**_body(model, ps[0], False), "max_tokens": 4})
        assert r.status_code == 200


def test_a_hung_expert_service_is_a_503_not_a_client_error(qwen3_ckpt: tuple) -> None:
    path: Path = qwen3_ckpt[0]
    with Served(["--model", str(path), "--dispatch-backend", "rpc", "--expert-services", "2",
                 "--expert-timeout", "2"]) as served:
        model = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        body = {**_body(model, [1, 2, 3], False), "max_tokens": 4}
        assert httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).is_success
        expert = next(pid for pid in served.children
                      if b"expert" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
        # Stopped, not killed: a hung service (serve would restart one that exited).
        os.kill(expert, signal.SIGSTOP)
        try:
            r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 503, r.text
            assert "expert rank" in r.json()["error"]["message"]
            health = httpx.get(f"{served.url}/health", timeout=30)
            assert health.status_code == 503 and "expert" in health.json()["error"]["message"]
        finally:
            os.kill(expert, signal.SIGCONT)  # so that it can stop cleanly, pass or fail
