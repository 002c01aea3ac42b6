"""Qwen2-MoE and the DeepSeek family served in every topology (expert services over rpc
and torch, DCP groups, one process), greedy outputs equal to transformers'."""

from __future__ import annotations

import socket

import httpx
import pytest

from common.ports import free_port
from switchyard.serve_process import Served
from tests.support.engines import prompts, reference_greedy
from tests.support.serving import concurrent_greedy

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(("family", "flags"), [
    ("deepseek_v3", ["--expert-services", "3"]),  # rpc, the default backend
    ("deepseek_v3", ["--dispatch-backend", "torch", "--expert-services", "3"]),
    ("deepseek_v3", ["--dcp-size", "2", "--expert-services", "2"]),
    ("deepseek_v3", ["--dcp-size", "3", "--expert-services", "2", "--micro-batches", "2"]),
    ("deepseek_v3", ["--dispatch-backend", "local"]),
    ("deepseek_v2", ["--expert-services", "3", "--micro-batches", "2"]),
    ("deepseek_v2", ["--dcp-size", "2", "--expert-services", "2"]),
    ("qwen2_moe", ["--expert-services", "3"]),
    ("qwen2_moe", ["--dcp-size", "2", "--expert-services", "2"]),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_serve_topologies_match_transformers(family: str, flags: list[str],
                                             request: pytest.FixtureRequest) -> None:
    path, model = request.getfixturevalue(f"{family}_ckpt")
    ps = prompts(seed=31, lengths=(2, 37, 15, 26))
    rendezvous = free_port()  # serve's --dist-init, where the torch backend meets
    dist = ["--dist-init", f"127.0.0.1:{rendezvous}"] if "torch" in flags else []
    with Served(["--model", str(path), "--max-num-batched-tokens", "16", *flags, *dist]
                ) as served:
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        got = concurrent_greedy(served.url, name, ps, max_tokens=16)
        health = httpx.get(f"{served.url}/health").json()
        if dist:  # attention rank 0 hosts the store there
            socket.create_connection(("127.0.0.1", rendezvous), timeout=5).close()
    assert got == [reference_greedy(model, p, 16) for p in ps]
    assert all(a["ready"] for a in health["attention"])
