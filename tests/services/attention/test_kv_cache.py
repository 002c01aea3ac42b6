"""Paged KV cache bookkeeping, and preemption by recompute keeping greedy output identical."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.messages import SamplingParams
from services.attention.block_manager import BlockManager
from services.attention.kv_cache import kv_bytes_per_block
from services.attention.sequence import Sequence
from tests.support.engines import engine_for, greedy, prompts, reference_greedy, run_to_completion


def seq(n_tokens: int, name: str = "s") -> Sequence:
    return Sequence(name, [1] * n_tokens, n_tokens, SamplingParams())


def test_allocation_rounds_up_to_blocks_and_free_returns_them() -> None:
    bm = BlockManager(blocks_per_rank=4, block_size=4)
    s = seq(6)
    assert bm.blocks_needed(s, 6) == [2]
    bm.allocate(s, 6)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 2
    s.num_computed_tokens = 6
    assert bm.blocks_needed(s, 2) == [0]  # slots 6, 7 are in block 2 of 2
    assert bm.blocks_needed(s, 3) == [1]
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 4 and bm.usage == 0.0


def test_exhaustion_is_refused_not_overcommitted() -> None:
    bm = BlockManager(blocks_per_rank=2, block_size=4)
    a, b = seq(8, "a"), seq(1, "b")
    bm.allocate(a, 8)
    assert not bm.can_allocate(b, 1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(b, 1)
    assert bm.num_free_blocks == 0 and b.block_table == []


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 20)), max_size=40))
def test_blocks_are_never_shared_or_lost(ops: list[tuple[int, int]]) -> None:
    bm = BlockManager(blocks_per_rank=16, block_size=4)
    seqs = [seq(0, str(i)) for i in range(6)]
    for i, n in ops:
        s = seqs[i]
        if n % 7 == 0:
            bm.free(s)
            s.num_computed_tokens = 0
        elif bm.can_allocate(s, n):
            bm.allocate(s, n)
            s.num_computed_tokens += n
        held = [b for x in seqs for b in x.block_table]
        assert len(held) == len(set(held))  # no block in two tables
        assert len(held) + bm.num_free_blocks == 16  # none lost
        assert all(len(x.block_table) * 4 >= x.num_computed_tokens for x in seqs)


def test_kv_budget_sets_block_count(qwen3_ckpt: tuple) -> None:
    """Blocks from the budget, sized from transformers' config (not our own translation of
    it): K and V, per layer, KV head, head dim and token; and the cache holds that much."""
    path, model = qwen3_ckpt
    engine = engine_for(path, kv_cache_memory=1 << 20, block_size=8)
    c = model.config
    per_block = (2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 8
                 * engine.dtype.itemsize)
    assert engine.block_manager.num_blocks == (1 << 20) // per_block
    held = sum(t.nbytes for t in engine.runner.kv.k + engine.runner.kv.v)
    assert held == engine.block_manager.num_blocks * per_block


def test_preempted_requests_finish_with_the_same_greedy_output(ckpt: tuple) -> None:
    path, model = ckpt
    ps = prompts(seed=5, lengths=(20, 17, 25, 14))
    expected = {f"r{i}": reference_greedy(model, p, 24) for i, p in enumerate(ps)}
    engine = engine_for(path, block_size=4)
    # Room for about two of the four sequences at full length: forces preemption.
    per_block = kv_bytes_per_block(engine.model_config, 4, engine.dtype)
    engine = engine_for(path, block_size=4, kv_cache_memory=per_block * 24,
                        max_num_batched_tokens=16)
    got = run_to_completion(engine, {0: [greedy(f"r{i}", p, 24) for i, p in enumerate(ps)]})
    assert engine.scheduler.num_preemptions > 0
    assert got == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_the_gpu_attention_kernel_matches_the_cpu_one() -> None:
    """`KVCache.attend` uses SDPA with grouped KV heads off the CPU; run both kernels on
    the CPU over the same paged batch (two decodes, one prefill chunk, a sliding window)
    and compare."""
    from types import SimpleNamespace

    import torch

    from dcp.batch import build_rank_batch
    from dcp.merge import partial_attention
    from dcp.sharding import Sharding
    from services.attention.batch import plan_step
    from services.attention.kv_cache import KVCache, sdpa
    from services.attention.scheduler import ScheduledSeq

    torch.manual_seed(0)
    cfg = SimpleNamespace(num_layers=1, num_kv_heads=2, head_dim=16, mla=None,
                          attention_scale=16 ** -0.5)
    kv = KVCache(cfg, num_blocks=17, block_size=4, dtype=torch.float32)
    kv.k[0].normal_()
    kv.v[0].normal_()
    seqs = []
    for i, (n, done, blocks) in enumerate([(20, 19, range(0, 5)), (30, 0, range(5, 13)),
                                           (13, 12, range(13, 17))]):  # 13 keys: 4 blocks
        s = seq(n, f"s{i}")
        s.num_computed_tokens, s.block_tables = done, [list(blocks)]
        seqs.append(ScheduledSeq(s, min(n - done, 12)))
    for window in (None, 7):
        plan, rows = plan_step(seqs)
        batch = build_rank_batch(plan, 0, Sharding(1, 1), 4, window, rows)
        q = torch.randn(batch.input_ids.shape[0], 4, 16)
        ours, _ = kv._attend(0, q, batch, partial_attention)
        full, _ = kv._attend(0, q, batch, sdpa)
        torch.testing.assert_close(full, ours, rtol=1e-5, atol=1e-5)


def test_every_running_sequence_decodes_every_step_even_with_a_small_budget() -> None:
    """A budget of 2 tokens and 4 requests: at most 2 run, each decoding every step, and
    the others start as they finish (the newest used to wait out every step unscheduled)."""
    from services.attention.scheduler import Scheduler

    bm = BlockManager(blocks_per_rank=64, block_size=4)
    scheduler = Scheduler(bm, max_num_batched_tokens=2, max_num_seqs=8)
    seqs = [seq(1, f"s{i}") for i in range(4)]
    for s in seqs:
        scheduler.add(s)
    for _ in range(5):
        step = scheduler.schedule()
        assert {x.seq.request_id for x in step} == {s.request_id for s in scheduler.running}
        for x in step:  # each computes its tokens and samples one more
            x.seq.num_computed_tokens += x.num_new_tokens
            x.seq.token_ids.append(1)
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2
    with pytest.raises(ValueError, match="must be at least 1"):
        Scheduler(bm, max_num_batched_tokens=0, max_num_seqs=8)
    with pytest.raises(ValueError, match="must be at least 1"):
        Scheduler(bm, max_num_batched_tokens=8, max_num_seqs=0)
