"""Logits and greedy continuations equal transformers' on tiny random Qwen3-MoE, Mixtral,
Qwen2-MoE and DeepSeek-V2/V3 checkpoints."""

from __future__ import annotations

import pytest
import torch

from tests.support.engines import (
    engine_for,
    greedy,
    prompts,
    reference_greedy,
    run_to_completion,
)


def test_prompt_logits_match_transformers(every_ckpt: tuple) -> None:
    path, model = every_ckpt
    engine = engine_for(path, max_num_batched_tokens=7)  # chunks smaller than the prompts
    for prompt in prompts():
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0]  # [L, V]
        got = engine.score(prompt)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() < 1e-4


def test_greedy_batched_with_chunked_prefill_and_late_arrivals(every_ckpt: tuple) -> None:
    path, model = every_ckpt
    ps = prompts(seed=3, lengths=(12, 3, 30, 21, 9))
    expected = {f"r{i}": reference_greedy(model, p, 32) for i, p in enumerate(ps)}
    engine = engine_for(path, max_num_batched_tokens=10)
    # Two arrive together, the others while those are mid-prefill or decoding.
    arrivals = {0: [greedy("r0", ps[0]), greedy("r1", ps[1])], 2: [greedy("r2", ps[2])],
                9: [greedy("r3", ps[3])], 20: [greedy("r4", ps[4])]}
    assert run_to_completion(engine, arrivals) == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_every_step_is_timed_by_its_kind(ckpt: tuple) -> None:
    from prometheus_client import REGISTRY

    def count(kind: str) -> float:
        return REGISTRY.get_sample_value("switchyard:engine_step_seconds_count",
                                         {"kind": kind}) or 0.0

    path, _ = ckpt
    engine = engine_for(path, max_num_batched_tokens=10)
    before = {kind: count(kind) for kind in ("prefill", "decode")}
    run_to_completion(engine, {0: [greedy("r0", prompts(lengths=(25,))[0], 4)]})
    # a 25-token prompt in 3 chunks of at most 10 (the last samples the first token),
    # then 3 decode steps for the other 3 tokens
    assert count("prefill") - before["prefill"] == 3
    assert count("decode") - before["decode"] == 3


@pytest.mark.parametrize("dense", ["none", "int8"])
@pytest.mark.parametrize("name", ["qwen3", "mixtral", "deepseek_v2", "deepseek_v2_grouped"])
def test_decode_steps_through_the_compiled_attention_block_are_the_same_bits(
        name: str, dense: str, request: pytest.FixtureRequest) -> None:
    """The compiled attention block (one call a layer at decode steps; MLA's too, with and
    without q_lora_rank; float32 or int8 weights) against the Python path over the same
    kernels: every step's logits equal, and the block did run."""
    path, _ = request.getfixturevalue(f"{name}_ckpt")
    ps = prompts(seed=4, lengths=(6, 11, 3))
    logits: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    compiled_steps = 0
    for compiled in (True, False):
        engine = engine_for(path, max_num_batched_tokens=32, dense_quantization=dense)
        model = engine.runner.model
        model._own_cache = compiled  # False: the path a DCP group's ranks take
        if compiled:
            assert model.compiled_block(*_decode_probe(model)) is not None
        forward_logits, block = model.logits, model.attention_block

        def record(hidden: torch.Tensor, into: list = logits[compiled],
                   fn: object = forward_logits) -> torch.Tensor:
            out = fn(hidden)  # type: ignore[operator]
            into.append(out.clone())
            return out

        def counted(*args: object, fn: object = block) -> object:
            nonlocal compiled_steps
            compiled_steps += args[-1] is not None
            return fn(*args)  # type: ignore[operator]

        model.logits, model.attention_block = record, counted  # type: ignore[method-assign]
        run_to_completion(engine, {0: [greedy(f"r{i}", p, 12) for i, p in enumerate(ps)]})
    assert compiled_steps >= 11 * engine.model_config.num_layers
    assert len(logits[True]) == len(logits[False])
    for got, want in zip(logits[True], logits[False], strict=True):
        assert torch.equal(got, want)


def _decode_probe(model: object) -> tuple[torch.Tensor, object]:
    """A one-row decode batch's shape, for `compiled_block`'s checks."""
    from dcp.batch import StepBatch

    one = torch.zeros(1, dtype=torch.int64)
    batch = StepBatch(one, one, one, one, one[None], torch.ones(1, 1, dtype=torch.bool), [],
                      one)
    return torch.zeros(1, model.cfg.hidden_size), batch  # type: ignore[attr-defined]
