"""Seeded sampling is reproducible alone and in a busy batch; top_k=1 equals greedy."""

from __future__ import annotations

import torch

from common.messages import GenerateRequest, SamplingParams
from services.attention.sampler import apply_penalties, filtered_probs, sample
from services.attention.sequence import Sequence
from tests.support.engines import engine_for, greedy, prompts, reference_greedy, run_to_completion


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
    tokens = sample(logits, _seqs(200, top_p=0.7, temperature=1.0)).tokens
    assert set(tokens) == {0, 1}  # 0.5 + 0.3 reaches 0.7; 2 and 3 are cut


def test_top_k_keeps_only_the_k_best() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]]).repeat(200, 1)
    assert set(sample(logits, _seqs(200, top_k=2, temperature=5.0)).tokens) == {1, 2}


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    tokens = sample(torch.log(probs).repeat(3000, 1), _seqs(3000, temperature=1.0)).tokens
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 3000
    assert (freq - probs).abs().max() < 0.04  # > 4 standard errors


def test_min_p_keeps_what_transformers_keeps() -> None:
    from transformers.generation.logits_process import MinPLogitsWarper

    logits = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 3
    for min_p in (0.05, 0.2, 0.9):
        ours = filtered_probs(logits, [SamplingParams(min_p=min_p)] * 16) > 0
        theirs = MinPLogitsWarper(min_p)(None, logits.clone()).isfinite()
        assert torch.equal(ours, theirs)


def test_repetition_penalty_equals_transformers() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, generator=g) * 3
    history = torch.randint(0, 64, (4, 12), generator=g)
    seqs = [Sequence(str(i), history[i].tolist(), 5,
                     SamplingParams(repetition_penalty=1.7)) for i in range(4)]
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(history, logits.clone())
    assert torch.allclose(apply_penalties(logits, seqs), theirs)


def test_min_tokens_masks_what_transformers_masks() -> None:
    """min_tokens against transformers' MinNewTokensLengthLogitsProcessor, given EOS and
    the stop ids as its "eos" ids: rows with 0 to 4 generated tokens, min_tokens 3. With
    ignore_eos, only the stop ids are masked (vLLM)."""
    from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 64, generator=g) * 3
    logits[:, 7], logits[:, 9] = 20.0, 21.0  # EOS and a stop id: what greedy would pick
    prompt, eos = [4, 5, 6], (7,)
    for ignore_eos, stops in ((False, [7, 9]), (True, [9])):
        params = SamplingParams(min_tokens=3, stop_token_ids=(9,), ignore_eos=ignore_eos,
                                temperature=0)
        for generated in range(5):
            ids = prompt + [11] * generated
            seq = Sequence("m", ids, len(prompt), params)
            theirs = MinNewTokensLengthLogitsProcessor(len(prompt), 3, stops)(
                torch.tensor([ids]), logits[generated:generated + 1].clone())
            ours = sample(logits[generated:generated + 1], [seq], eos).tokens
            assert ours == theirs.argmax(dim=-1).tolist()
            assert (ours[0] in stops) == (generated >= 3)


def test_min_tokens_generates_what_transformers_generate_does(qwen3_ckpt: tuple) -> None:
    """Greedy with a stop token id that greedy picks early: the engine with min_tokens
    against transformers' `generate(min_new_tokens=..., eos_token_id=...)`."""
    path, model = qwen3_ckpt
    prompt = prompts(seed=12, lengths=(10,))[0]
    stop = reference_greedy(model, prompt, 1)[0]  # the first token greedy would pick
    for min_tokens in (0, 1, 4):
        request = GenerateRequest("m", prompt, SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop,),
            min_tokens=min_tokens))
        got = run_to_completion(engine_for(path), {0: [request]})["m"]
        with torch.no_grad():
            want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                                  min_new_tokens=min_tokens, eos_token_id=[stop],
                                  pad_token_id=stop)[0, len(prompt):].tolist()
        assert got == want and stop not in got[:min_tokens]
        assert got[-1] == stop or len(got) == 12  # stopped by it, or ran to max_tokens
        if min_tokens == 0:
            assert got == [stop]  # what min_tokens changes: without it, it stops at once
    refused = engine_for(path).add(GenerateRequest("x", prompt, SamplingParams(
        max_tokens=2, min_tokens=3)))
    assert refused is not None and refused.error == "min_tokens must be between 0 and max_tokens"


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    # OpenAI: mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, where c
    # counts token j among the generated tokens only (the prompt's 3 tokens do not count).
    logits = torch.zeros(1, 6)
    seq = Sequence("p", [5, 5, 5, 1, 1, 2, 1], 3,
                   SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    got = apply_penalties(logits, [seq])[0]
    assert got.tolist() == [0.0, -(3 * 0.25 + 0.5), -(0.25 + 0.5), 0.0, 0.0, 0.0]


def test_penalties_change_what_greedy_picks() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0]])
    seq = Sequence("p", [0, 1, 1], 1, SamplingParams(temperature=0.0, frequency_penalty=1.0))
    assert sample(logits, [seq]).tokens == [2]  # 5 - 2 * 1 < 4


def test_logprobs_are_the_models_and_rank_the_top_tokens(qwen3_ckpt: tuple) -> None:
    path, model = qwen3_ckpt
    prompt = prompts(seed=3, lengths=(7,))[0]
    engine = engine_for(path)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True, logprobs=3)
    assert engine.add(GenerateRequest("lp", prompt, params)) is None
    deltas = []
    while engine.has_work():
        deltas += engine.step()
    tokens = [t for d in deltas for t in d.token_ids]
    entries = [e for d in deltas for e in (d.logprobs or [])]
    assert len(entries) == len(tokens) == 6
    with torch.no_grad():
        ref = model(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)  # [L, V]
    for i, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry.logprob - float(row[token])) < 1e-4
        top = row.topk(3)
        assert entry.top_ids == top.indices.tolist()
        assert torch.allclose(torch.tensor(entry.top_logprobs), top.values, atol=1e-4)
    first = next(d for d in deltas if d.token_ids)
    assert first.queue_time_s is not None and first.queue_time_s >= 0
    assert first.prefill_time_s is not None and first.prefill_time_s > 0


def test_prompt_logprobs_are_the_models_through_chunks_and_preemption(qwen3_ckpt: tuple
                                                                     ) -> None:
    """vLLM's prompt logprobs (what `echo` with `logprobs` returns): prompt token j's
    log-probability given tokens < j, its rank and the top alternatives, equal to
    transformers' over prompts cut into chunks and preempted; sent once, with the first
    token."""
    from services.attention.kv_cache import kv_bytes_per_block

    path, model = qwen3_ckpt
    ps = prompts(seed=6, lengths=(20, 17, 25, 14))
    asks = [2, None, 0, 5]  # prompt_logprobs per request
    per_block = kv_bytes_per_block(engine_for(path).model_config, 4, torch.float32)
    engine = engine_for(path, block_size=4, kv_cache_memory=per_block * 24,
                        max_num_batched_tokens=16)
    for i, (p, k) in enumerate(zip(ps, asks, strict=True)):
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                prompt_logprobs=k)
        assert engine.add(GenerateRequest(f"r{i}", p, params)) is None
    sent: dict[str, list] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.prompt_logprobs is not None:
                assert d.request_id not in sent and len(tokens[d.request_id]) == 1
                sent[d.request_id] = d.prompt_logprobs
    assert engine.scheduler.num_preemptions > 0
    assert tokens == {f"r{i}": reference_greedy(model, p, 24) for i, p in enumerate(ps)}
    assert sorted(sent) == ["r0", "r2", "r3"]
    for i, (p, k) in enumerate(zip(ps, asks, strict=True)):
        if k is None:
            continue
        entries = sent[f"r{i}"]
        assert len(entries) == len(p) and entries[0] is None
        with torch.no_grad():
            ref = model(torch.tensor([p])).logits[0].log_softmax(-1)  # [L, V]
        for j, entry in enumerate(entries[1:], start=1):
            row, token = ref[j - 1], p[j]
            assert abs(entry.logprob - float(row[token])) < 1e-4
            assert entry.rank == int((row > row[token]).sum()) + 1
            top = row.topk(k)
            assert entry.top_ids == top.indices.tolist()
            assert torch.allclose(torch.tensor(entry.top_logprobs), top.values, atol=1e-4)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_logit_bias_and_allowed_token_ids_shape_what_is_sampled_not_logprobs() -> None:
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(9))
    best = logits.argmax(dim=-1).tolist()
    worst = logits.argmin(dim=-1).tolist()
    seqs = [Sequence("ban", [1], 1, SamplingParams(temperature=0.0, logprobs=1,
                                                   logit_bias=((best[0], -100.0),))),
            Sequence("push", [1], 1, SamplingParams(temperature=0.0,
                                                    logit_bias=((worst[1], 100.0),))),
            Sequence("only", [1], 1, SamplingParams(seed=3, allowed_token_ids=(4, 9)))]
    out = sample(logits, seqs)
    second = logits[0].topk(2).indices[1].item()
    assert out.tokens[:2] == [second, worst[1]]
    assert out.tokens[2] in (4, 9)
    entry = out.logprobs[0]  # raw: the banned token is still the likeliest
    assert entry is not None and entry.top_ids == [best[0]]
    draws = {sample(logits[2:], [Sequence("o", [1], 1, SamplingParams(
        seed=s, temperature=2.0, allowed_token_ids=(4, 9)))]).tokens[0] for s in range(40)}
    assert draws == {4, 9}
    # only stop tokens allowed, before min_tokens: the allowed ones win, not token 0
    stuck = Sequence("s", [1], 1, SamplingParams(temperature=0.0, min_tokens=3,
                                                 allowed_token_ids=(7, 11),
                                                 stop_token_ids=(7,)))
    assert sample(logits[:1], [stuck], eos_token_ids=(11,)).tokens[0] in (7, 11)


def test_extreme_parameters_never_break_the_batch() -> None:
    # Found by the gateway fuzz test: these once made NaN probabilities and failed the step.
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(4)) * 4
    extreme = [dict(temperature=5e-324), dict(top_p=5e-324), dict(top_p=1e-306),
               dict(repetition_penalty=5e-324), dict(min_p=1.0, temperature=1e30)]
    seqs = [Sequence(str(i), [1, 2, 3], 2, SamplingParams(seed=i, **kw))  # type: ignore[arg-type]
            for i, kw in enumerate(extreme)]
    tokens = sample(logits, seqs).tokens
    assert all(0 <= t < 32 for t in tokens)
    # A tiny temperature or top_p means: the most likely token.
    assert tokens[:3] == logits[:3].argmax(dim=-1).tolist()


def test_top_p_one_keeps_the_whole_vocabulary() -> None:
    """top_p 1 disables the filter (vLLM): float32's cumulative sum reaches 1 before a
    large vocabulary's tail, which used to be dropped."""
    logits = torch.randn(4, 151_936, generator=torch.Generator().manual_seed(0)) * 8
    params = [SamplingParams(top_p=1.0)] * 4
    assert filtered_probs(logits, params).gt(0).all()
    assert torch.allclose(filtered_probs(logits, params), logits.softmax(-1))


def test_sampling_params_out_of_range_are_refused_alone(qwen3_ckpt: tuple) -> None:
    """The attention service is reachable without the gateway: a request whose parameters
    would make sampling raise is refused, and the batch beside it runs on."""
    import math

    path, _ = qwen3_ckpt
    engine = engine_for(path)
    vocab = engine.model_config.vocab_size
    bad = {"stop_token_ids": dict(stop_token_ids=(vocab,), min_tokens=1),
           "logprobs": dict(logprobs=vocab + 1), "logprobs ": dict(logprobs=-1),
           "prompt_logprobs": dict(prompt_logprobs=vocab + 1),
           "logit_bias": dict(logit_bias=((vocab, 1.0),)),
           "logit_bias ": dict(logit_bias=((1, 101.0),)),
           "allowed_token_ids": dict(allowed_token_ids=(vocab,)),
           "temperature": dict(temperature=math.nan), "temperature ": dict(temperature=-1.0),
           "top_p": dict(top_p=0.0), "top_p ": dict(top_p=math.nan),
           "min_p": dict(min_p=1.5), "repetition_penalty": dict(repetition_penalty=0.0),
           "presence_penalty": dict(presence_penalty=math.inf),
           "frequency_penalty": dict(frequency_penalty=math.nan)}
    good = greedy("good", prompts(seed=3, lengths=(6,))[0], 5)
    assert engine.add(good) is None
    for name, kw in bad.items():
        refused = engine.add(sampled(f"bad {name}", [1, 2, 3], **kw))
        assert refused is not None and refused.finish_reason == "error", name
        assert name.strip() in (refused.error or ""), (name, refused.error)
    deltas = [d for _ in range(6) for d in engine.step()]
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
    assert sum(len(d.token_ids) for d in deltas) == 5
    assert engine.add(sampled("edges", [1, 2], stop_token_ids=(vocab - 1,), logprobs=vocab,
                              top_p=1.0, min_p=1.0, presence_penalty=-2.0)) is None
