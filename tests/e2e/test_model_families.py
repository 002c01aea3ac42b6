"""Qwen2-MoE and the DeepSeek family served in every topology (expert services over rpc
and torch, DCP groups, one process), greedy outputs equal to transformers'."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from common.ports import free_port
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine
from services.expert.quantize import main as quantize_main
from services.model.config import ModelConfig
from switchyard.children import Children
from switchyard.serve_process import Served
from tests.support.engines import (
    dcp_engine,
    greedy,
    prompts,
    reference_greedy,
    run_to_completion,
)
from tests.support.serving import concurrent_greedy, served_greedy

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
    got, health, _ = served_greedy(path, flags, ps, max_tokens=16)
    assert got == [reference_greedy(model, p, 16) for p in ps]
    assert all(a["ready"] for a in health["attention"])


def test_w4a4_experts_of_deepseek_v3_quantized_and_served(deepseek_v3_ckpt: tuple,
                                                          tmp_path: Path) -> None:
    """`switchyard quantize` writes the routed experts as MXFP4 (shared experts and dense
    layers stay in the checkpoint's dtype, on the attention service); the packed copy
    serves what quantizing at load serves, in one process and over expert services."""
    path, _ = deepseek_v3_ckpt
    out = tmp_path / "w4a4"
    assert quantize_main(["--model", str(path), "--out", str(out)]) == 0
    assert ModelConfig.from_dir(out).quantization == "w4a4"
    ps = prompts(seed=6, lengths=(5, 23))

    def engine(p: Path, **kw: object) -> Engine:
        return build_engine(AttentionConfig(model=p, max_num_batched_tokens=16,
                                            kv_cache_memory=1 << 22, **kw))  # type: ignore

    full, packed = engine(path), engine(out)
    assert torch.equal(packed.score(ps[1]), engine(path, quantization="w4a4").score(ps[1]))
    want, got = full.score(ps[1]), packed.score(ps[1])
    assert float((got - want).norm() / want.norm()) < 0.25  # 4-bit experts, not garbage
    reqs = {0: [greedy(f"r{i}", p, 12) for i, p in enumerate(ps)]}
    local = run_to_completion(packed, reqs)
    with Served(["--model", str(out), "--expert-services", "2"]) as served:
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        assert concurrent_greedy(served.url, name, ps, max_tokens=12) == [
            local[f"r{i}"] for i in range(len(ps))]


@pytest.mark.parametrize(("family", "size"), [("deepseek_v3", 2), ("deepseek_v2", 3)])
def test_dcp_over_the_latent_cache_matches_transformers_logits(
        family: str, size: int, request: pytest.FixtureRequest) -> None:
    """Each rank holds its interleaved share of the latent rows; decodes (absorbed) and
    prefill chunks (expanded) merge their partial values: logits within 1e-4 of
    transformers', greedy outputs equal, batched with a late arrival."""
    path, model = request.getfixturevalue(f"{family}_ckpt")
    ps = prompts(seed=51, lengths=(40, 5, 23))
    with dcp_engine(path, size) as engine:
        for prompt in ps:
            with torch.no_grad():
                want = model(torch.tensor([prompt])).logits[0]
            assert (engine.score(prompt) - want).abs().max() < 1e-4
        got = run_to_completion(engine, {0: [greedy("a", ps[0], 16), greedy("b", ps[1], 16)],
                                         5: [greedy("c", ps[2], 16)]})
    assert got == {k: reference_greedy(model, p, 16) for k, p in zip("abc", ps, strict=True)}


@pytest.mark.parametrize("backend", ["rpc", "torch"])
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe"])
def test_expert_services_give_transformers_logits(family: str, backend: str,
                                                  request: pytest.FixtureRequest) -> None:
    """This process is the attention service (shared experts and dense layers in it),
    3 expert service processes hold the routed experts, over `rpc` or a gloo world."""
    path, model = request.getfixturevalue(f"{family}_ckpt")
    port = free_port()
    dist = ["--dispatch-backend", "torch", "--dist-init", f"127.0.0.1:{port}"] \
        if backend == "torch" else []
    children = Children()
    # Over torch, expert ranks report ready only once this rank has joined the world too.
    pending = [children.spawn(f"expert {r}", [
        "expert", "--model", str(path), "--rank", str(r), "--num-ranks", "3",
        "--num-threads", "1", *dist]) for r in range(3)]
    try:
        deadline = time.monotonic() + 120
        if backend == "rpc":
            ports = [children.wait_ports(p, deadline)[0] for p in pending]
            config = AttentionConfig(model=path, dispatch_backend="rpc", expert_addresses=tuple(
                ("127.0.0.1", p) for p in ports), max_num_batched_tokens=8,
                kv_cache_memory=1 << 22)
        else:
            config = AttentionConfig(model=path, dispatch_backend="torch",
                                     dist_init=("127.0.0.1", port), expert_ranks=3,
                                     max_num_batched_tokens=8, kv_cache_memory=1 << 22,
                                     expert_timeout=120)
        engine = build_engine(config)
        try:
            if backend == "torch":
                assert [children.wait_ports(p, deadline) for p in pending] == [(0,)] * 3
            for prompt in prompts(seed=9, lengths=(29, 3)):
                with torch.no_grad():
                    want = model(torch.tensor([prompt])).logits[0]
                assert (engine.score(prompt) - want).abs().max() < 1e-4
        finally:
            engine.close()
    finally:
        children.stop()

