"""Engines and services the tests build over the tiny checkpoints: prompts, transformers' greedy
continuations (the oracle), an engine in this process, a DCP group over peer processes,
expert services as real processes."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from common.messages import GenerateRequest, SamplingParams, TokenDelta
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine
from switchyard.children import Children
from switchyard.dcp_leader import leader_engine
from tests.support.checkpoints import VOCAB

PROMPT_LENGTHS = (1, 5, 19, 40)


def prompts(seed: int = 0, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]


def reference_greedy(model: object, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation recomputing the whole sequence each step (no cache to get wrong)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def engine_for(path: object, **overrides: object) -> Engine:
    kw: dict = {"model": path, "max_num_batched_tokens": 8, "kv_cache_memory": 1 << 22}
    kw.update(overrides)
    return build_engine(AttentionConfig(**kw))


def greedy(request_id: str, prompt: list[int], n: int = 32) -> GenerateRequest:
    return GenerateRequest(request_id, prompt,
                           SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


def run_to_completion(engine: Engine, arrivals: dict[int, list[GenerateRequest]],
                      seen: Callable[[TokenDelta], object] = lambda delta: None) -> dict:
    """Step the engine, adding arrivals[k] before step k, and `seen` every delta; returns
    request id -> tokens."""
    out: dict[str, list[int]] = {}
    step = 0
    while engine.has_work() or any(k >= step for k in arrivals):
        for req in arrivals.get(step, []):
            assert engine.add(req) is None
        for d in engine.step():
            seen(d)
            out.setdefault(d.request_id, []).extend(d.token_ids)
        step += 1
    return out


KV_BUDGET = 1 << 20  # per rank: 85 blocks of 16 tokens on the tiny model (12 KiB a block)


ENGINE = dict(max_num_batched_tokens=16, kv_cache_memory=KV_BUDGET, block_size=16)


def dcp_engine(path: Path, size: int, interleave: int = 1, **kw: object
               ) -> AbstractContextManager[Engine]:
    return leader_engine(path, size, interleave, **{**ENGINE, **kw})


def start_experts(path: Path, num_ranks: int, placement: Path | None = None
                  ) -> tuple[Children, list[tuple[str, int]]]:
    children = Children()
    extra = ["--placement", str(placement)] if placement else []
    try:
        ports = children.start_all([
            (f"expert {r}", ["expert", "--model", str(path), "--rank", str(r),
                             "--num-ranks", str(num_ranks), "--num-threads", "1", *extra])
            for r in range(num_ranks)], timeout=120)
    except BaseException:
        children.stop()
        raise
    return children, [("127.0.0.1", p) for p, *_ in ports]
