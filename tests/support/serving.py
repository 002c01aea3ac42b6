"""Clients of a served gateway: the official `openai` client, the served model's id,
concurrent greedy requests, one streamed completion's tokens, and a topology served for
them."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from common.ports import free_port
from switchyard.serve_process import Served
from tests.support.metrics_text import Labels, scrape


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


def served_greedy(path: Path, flags: list[str], ps: list[list[int]], max_tokens: int
                  ) -> tuple[list[list[int]], dict, dict[str, dict[Labels, float]]]:
    """`switchyard serve` of `path` with `flags` (a torch backend's --dist-init added),
    every prompt at once: (their greedy outputs, /health, /metrics' samples) read while
    it serves."""
    rendezvous = free_port()  # serve's --dist-init, where the torch backend meets
    dist = ["--dist-init", f"127.0.0.1:{rendezvous}"] if "torch" in flags else []
    with Served(["--model", str(path), "--max-num-batched-tokens", "16", *flags, *dist]
                ) as served:
        got = concurrent_greedy(served.url, model_id(served), ps, max_tokens)
        health = httpx.get(f"{served.url}/health").json()
        samples = scrape(f"{served.url}/metrics")  # summed over the groups
        if dist:  # attention rank 0 hosts the store there (it used to pick its own port)
            socket.create_connection(("127.0.0.1", rendezvous), timeout=5).close()
    return got, health, samples


def stream_tokens(url: str, model: str, prompt: list[int], body: dict,
                  first: threading.Event, out: dict) -> None:
    """One streamed completion of the token ids `prompt` (`body`: its other fields): its
    status, token ids, finish reason, usage and error if any into `out`; `first` set once
    4 tokens came (a test's cue to disturb the server mid-stream)."""
    tokens: list[int] = []
    out["tokens"] = tokens
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **body}) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the stream's end, as vLLM reports it
                out["error"] = chunk["error"]
                continue
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
            for choice in chunk["choices"]:
                tokens += choice.get("token_ids") or []
                out["finish"] = choice.get("finish_reason") or out.get("finish")
            if len(tokens) >= 4:
                first.set()


def disturbed_streams(url: str, model: str, ps: list[list[int]], body: dict,
                      disturb: Callable[[], None] | None) -> list[dict]:
    """Stream every prompt at once (`stream_tokens`); run `disturb` (a test's kill or
    stop) once every stream has its first tokens; each stream's `out`, once ended."""
    outs: list[dict] = [{} for _ in ps]
    firsts = [threading.Event() for _ in ps]
    threads = [threading.Thread(target=stream_tokens, args=(url, model, p, body, f, o))
               for p, f, o in zip(ps, firsts, outs, strict=True)]
    for t in threads:
        t.start()
    try:
        assert all(f.wait(60) for f in firsts)
        if disturb is not None:
            disturb()
    finally:
        for t in threads:
            t.join(180)
    return outs
