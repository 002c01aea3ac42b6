"""Logits and greedy continuations equal transformers' on tiny random Qwen3-MoE and Mixtral."""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.messages import GenerateRequest, SamplingParams, TokenDelta
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine
from tests.checkpoints import VOCAB

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


def test_prompt_logits_match_transformers(ckpt: tuple) -> None:
    path, model = ckpt
    engine = engine_for(path, max_num_batched_tokens=7)  # chunks smaller than the prompts
    for prompt in prompts():
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0]  # [L, V]
        got = engine.score(prompt)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() < 1e-4


def test_greedy_batched_with_chunked_prefill_and_late_arrivals(ckpt: tuple) -> None:
    path, model = ckpt
    ps = prompts(seed=3, lengths=(12, 3, 30, 21, 9))
    expected = {f"r{i}": reference_greedy(model, p, 32) for i, p in enumerate(ps)}
    engine = engine_for(path, max_num_batched_tokens=10)
    # Two arrive together, the others while those are mid-prefill or decoding.
    arrivals = {0: [greedy("r0", ps[0]), greedy("r1", ps[1])], 2: [greedy("r2", ps[2])],
                9: [greedy("r3", ps[3])], 20: [greedy("r4", ps[4])]}
    assert run_to_completion(engine, arrivals) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
