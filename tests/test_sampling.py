"""Seeded sampling is reproducible alone and in a busy batch; top_k=1 equals greedy."""

from __future__ import annotations

import torch

from services.attention.sampler import sample
from services.attention.sequence import Sequence
from switchyard.messages import GenerateRequest, SamplingParams
from tests.test_engine_parity import engine_for, greedy, prompts, run_to_completion


def sampled(rid: str, prompt: list[int], **kw: object) -> GenerateRequest:
    params = SamplingParams(max_tokens=24, ignore_eos=True, **kw)  # type: ignore[arg-type]
    return GenerateRequest(rid, prompt, params)


def test_same_seed_same_tokens_alone_and_in_a_busy_batch(qwen3_ckpt: tuple) -> None:
    path, _ = qwen3_ckpt
    p = prompts(seed=7, lengths=(9,))[0]
    alone = run_to_completion(engine_for(path), {0: [sampled("x", p, seed=1234,
                                                             temperature=1.0)]})
    others = [sampled(f"o{i}", q, temperature=1.3, top_p=0.9)
              for i, q in enumerate(prompts(seed=8, lengths=(4, 30, 11, 22)))]
    busy = run_to_completion(engine_for(path), {0: others[:2],
                                                3: [sampled("x", p, seed=1234,
                                                            temperature=1.0)],
                                                5: others[2:]})
    assert busy["x"] == alone["x"]
    different_seed = run_to_completion(engine_for(path), {0: [sampled("x", p, seed=99,
                                                                      temperature=1.0)]})
    assert different_seed["x"] != alone["x"]  # the seed matters (24 tokens over 255 choices)


def test_top_k_1_equals_greedy(qwen3_ckpt: tuple) -> None:
    path, _ = qwen3_ckpt
    ps = prompts(seed=9, lengths=(6, 15))
    want = run_to_completion(engine_for(path), {0: [greedy(f"r{i}", p, 24)
                                                    for i, p in enumerate(ps)]})
    got = run_to_completion(engine_for(path), {0: [sampled(f"r{i}", p, top_k=1,
                                                           temperature=1.5)
                                                   for i, p in enumerate(ps)]})
    assert got == want


def _seqs(n: int, **kw: object) -> list[Sequence]:
    return [Sequence(str(i), [0], 1, SamplingParams(seed=i, **kw)) for i in range(n)]  # type: ignore[arg-type]


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(200, 1)
    tokens = sample(logits, _seqs(200, top_p=0.7, temperature=1.0))
    assert set(tokens) == {0, 1}  # 0.5 + 0.3 reaches 0.7; 2 and 3 are cut


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]]).repeat(200, 1)
    assert set(sample(logits, _seqs(200, top_k=2, temperature=5.0))) == {1, 2}


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    tokens = sample(torch.log(probs).repeat(3000, 1), _seqs(3000, temperature=1.0))
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 3000
    assert (freq - probs).abs().max() < 0.04  # > 4 standard errors
