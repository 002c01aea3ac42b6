"""Clients of a served gateway: the official `openai` client, the served model's id, and
concurrent greedy requests."""

from __future__ import annotations

import asyncio

import httpx
import openai

from switchyard.serve_process import Served


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


def model_id(served: Served) -> str:
    return httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]


def concurrent_greedy(url: str, model: str, ps: list[list[int]], max_tokens: int
                      ) -> list[list[int]]:
    """Send every token-id prompt at once (greedy, exact length); their output token ids."""

    async def one(c: httpx.AsyncClient, p: list[int]) -> list[int]:
        r = await c.post("/v1/completions", json={
            "model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    async def all_at_once() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in ps))

    return asyncio.run(all_at_once())
