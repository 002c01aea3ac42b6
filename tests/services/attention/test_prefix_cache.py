"""Prefix caching: shared blocks hold exactly the KV their sharers would have computed (a
fuzzed model of the cache's contents), and requests served from the cache generate what
transformers generates, alone, batched, preempted and across a DCP group."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.messages import GenerateRequest, SamplingParams, TokenDelta
from dcp.sharding import Sharding
from services.attention.block_manager import BlockManager
from services.attention.engine import Engine
from services.attention.prefix_cache import CachedPrefix
from services.attention.sequence import Sequence
from tests.support.engines import engine_for, greedy, prompts, reference_greedy, run_to_completion

# --- the block manager against a model of what each KV slot holds -----------------------


class Contents:
    """What every (rank, slot) of a group's caches holds: the salt and the tokens up to and
    including the one whose KV was written there (the KV's whole dependence)."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: dict[tuple[int, int], tuple[str | None, tuple[int, ...]]] = {}

    def where(self, seq: Sequence, pos: int) -> tuple[int, int]:
        s, bs = self.bm.sharding, self.bm.block_size
        rank = int(s.owner(torch.tensor(pos)))
        local = int(s.local_index(torch.tensor(pos)))
        return rank, seq.block_tables[rank][local // bs] * bs + local % bs

    def compute(self, seq: Sequence, n: int) -> None:
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.slots[self.where(seq, pos)] = (seq.cache_salt, tuple(seq.token_ids[:pos + 1]))

    def check_found(self, seq: Sequence, num_tokens: int) -> None:
        for pos in range(num_tokens):
            assert self.slots[self.where(seq, pos)] == (seq.cache_salt,
                                                        tuple(seq.token_ids[:pos + 1]))


def check_books(bm: BlockManager, seqs: list[Sequence]) -> None:
    for r in range(bm.sharding.size):
        held = [b for s in seqs if s.block_tables for b in s.block_tables[r]]
        refs = bm._refs[r]
        assert all(refs[b] == held.count(b) for b in range(bm.blocks_per_rank))
        assert set(bm._free[r]) == {b for b in range(bm.blocks_per_rank) if refs[b] == 0}
    for s in seqs:
        for r, table in enumerate(s.block_tables):  # enough blocks for what it computed
            owned = bm.sharding.num_owned(r, s.num_computed_tokens)
            assert len(table) * bm.block_size >= owned


LAYOUTS = [(1, 1, 4), (2, 1, 4), (3, 2, 4), (2, 8, 4)]  # (ranks, interleave, block size)
BASES = [[random.Random(b).randrange(5) for _ in range(80)] for b in range(3)]
Op = tuple[str, int, int, int, str | None]  # (what, which sequence, base, length, salt)
OPS = st.tuples(st.sampled_from(["add", "step", "step", "step", "free", "preempt"]),
                st.integers(0, 7), st.integers(0, 2), st.integers(1, 60),
                st.sampled_from([None, "s"]))


def exercise(layout: tuple[int, int, int], blocks: int, ops: list[Op]) -> int:
    """Apply `ops` to a prefix-caching block manager, checking the found KV and the books
    after each; returns how many tokens were found in the cache."""
    size, interleave, bs = layout
    bm = BlockManager(blocks, bs, Sharding(size, interleave), prefix_caching=True)
    kv = Contents(bm)
    seqs: list[Sequence] = []
    found = 0
    for op, i, base, n, salt in ops:
        if op == "add" or not seqs:
            prompt = BASES[base][:n] + [9] * (i % 3)
            seqs.append(Sequence(f"s{len(seqs)}", prompt, len(prompt), SamplingParams(),
                                 cache_salt=salt))
            continue
        seq = seqs[i % len(seqs)]
        if op in ("free", "preempt"):
            bm.free(seq)
            seq.num_computed_tokens = 0
            if op == "free":
                seqs.remove(seq)
        elif seq.num_computed_tokens == seq.num_tokens:  # computed all: "sample" a token
            seq.token_ids.append(n % 5)
        else:
            cached = bm.lookup(seq)
            assert cached.num_tokens <= seq.num_tokens - 1
            assert cached.num_tokens % bm.span == 0
            chunk = min(n, seq.num_tokens - max(seq.num_computed_tokens, cached.num_tokens))
            if bm.can_allocate(seq, chunk, cached):
                bm.allocate(seq, chunk, cached)
                kv.check_found(seq, cached.num_tokens)
                found += cached.num_tokens
                kv.compute(seq, chunk)
                seq.num_computed_tokens += chunk
                bm.cache_computed(seq)
        check_books(bm, seqs)
    for seq in seqs:
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_blocks
    return found


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(LAYOUTS), st.integers(4, 40), st.lists(OPS, max_size=60))
def test_found_blocks_hold_exactly_what_the_sequence_would_compute(
        layout: tuple[int, int, int], blocks: int, ops: list[Op]) -> None:
    """Sequences drawn from a few shared prefixes (with a salt or not) are added, stepped
    by chunks (taking their cached prefix when they start), freed or preempted, in any
    order and under any block pressure. Every prefix the cache gives holds the KV of those
    very tokens (and salt), never reaches the last token, and no block is lost or shared
    while it can be written."""
    exercise(layout, blocks, ops)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_the_model_check_finds_prefixes_in_every_layout(layout: tuple[int, int, int]
                                                       ) -> None:
    """The fuzzed check is not vacuous: long seeded runs find cached prefixes."""
    rng = random.Random(7)
    ops = [(rng.choice(["add", "step", "step", "step", "free", "preempt"]), rng.randrange(8),
            rng.randrange(3), rng.randrange(1, 61), rng.choice([None, "s"]))
           for _ in range(400)]
    assert exercise(layout, 24, ops) > 0


def test_a_shared_prefix_is_found_in_whole_blocks_and_shared_not_copied() -> None:
    bm = BlockManager(8, 4, prefix_caching=True)
    a = Sequence("a", list(range(10)), 10, SamplingParams())
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_computed(a)  # blocks of tokens 0-3 and 4-7; 8-9 fill half a block
    b = Sequence("b", [*range(8), 42, 43], 10, SamplingParams())
    cached = bm.lookup(b)
    assert cached == CachedPrefix(8, ((a.block_table[0], a.block_table[1]),))
    bm.allocate(b, 2, cached)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # the partial block is its own
    assert bm.num_free_blocks == 8 - 4
    same = Sequence("same", list(range(8)), 8, SamplingParams())
    assert bm.lookup(same).num_tokens == 4  # the last token always runs: it samples
    salted = Sequence("salted", list(range(10)), 10, SamplingParams(), cache_salt="t")
    assert bm.lookup(salted).num_tokens == 0
    assert bm.lookup(Sequence("x", [1, *range(1, 10)], 10, SamplingParams())).num_tokens == 0


def test_cached_blocks_are_handed_out_last_and_least_recently_freed_first() -> None:
    bm = BlockManager(6, 2, prefix_caching=True)
    old = Sequence("old", [1, 2, 3, 4, 5], 5, SamplingParams())
    new = Sequence("new", [6, 7, 8, 9, 10], 5, SamplingParams())
    for s in (old, new):
        bm.allocate(s, 5)
        s.num_computed_tokens = 5
        bm.cache_computed(s)  # two full blocks each, and a partial one
    bm.free(old)
    bm.free(new)
    def found(tokens: list[int]) -> int:
        return bm.lookup(Sequence("probe", tokens, len(tokens), SamplingParams())).num_tokens

    taker = Sequence("t", [0] * 12, 12, SamplingParams())
    bm.allocate(taker, 4)  # two blocks: the two partial ones, which hold nothing to keep
    assert found([1, 2, 3, 4, 5]) == found([6, 7, 8, 9, 10]) == 4
    taker.num_computed_tokens = 4
    bm.allocate(taker, 2)  # then the least recently freed sequence's later block
    assert found([1, 2, 3, 4, 5]) == 2 and found([6, 7, 8, 9, 10]) == 4
    taker.num_computed_tokens = 6
    bm.allocate(taker, 4)
    assert found([1, 2, 3, 4, 5]) == 0 and found([6, 7, 8, 9, 10]) == 2


def test_without_prefix_caching_nothing_is_found() -> None:
    bm = BlockManager(8, 4)
    a = Sequence("a", list(range(10)), 10, SamplingParams())
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_computed(a)
    assert bm.lookup(Sequence("b", list(range(10)), 10, SamplingParams())).num_tokens == 0


# --- engines: what cached requests generate equals transformers -----------------------


def run(engine: Engine, arrivals: dict[int, list[GenerateRequest]]
        ) -> tuple[dict[str, list[int]], dict[str, int | None]]:
    """`run_to_completion`, and the cached prompt tokens each request's first delta says."""
    cached: dict[str, int | None] = {}

    def first(delta: TokenDelta) -> None:
        cached.setdefault(delta.request_id, delta.num_cached_tokens)

    return run_to_completion(engine, arrivals, first), cached


def shared_prefix_prompts() -> dict[str, list[int]]:
    system = prompts(seed=61, lengths=(37,))[0]  # a "system prompt" of 2 blocks + 5 tokens
    tails = prompts(seed=62, lengths=(6, 11, 1))
    return {"first": system + tails[0], "other": system + tails[1],
            "same": system + tails[0], "short": system[:20] + tails[2]}


def test_requests_sharing_a_prefix_hit_and_generate_what_transformers_does(
        ckpt: tuple) -> None:
    """`first` runs alone; then three arrive together: the same prompt (all but its last
    token found, in whole blocks), another tail on the same system prompt, and one sharing
    only its first block. A multi-turn follow-up (prompt + first's answer + more) finds
    first's generated tokens too."""
    path, model = ckpt
    ps = shared_prefix_prompts()
    engine = engine_for(path, max_num_batched_tokens=12, block_size=16)
    got, cached = run(engine, {0: [greedy("first", ps["first"], 20)]})
    assert cached == {"first": 0}
    follow = ps["first"] + got["first"] + [3, 4, 5]
    later = {0: [greedy(k, ps[k], 20) for k in ("other", "same", "short")]
             + [greedy("follow", follow, 8)]}
    more, more_cached = run(engine, later)
    got.update(more)
    cached.update(more_cached)
    assert cached == {"first": 0, "other": 32, "same": 32, "short": 16, "follow": 48}
    ps["follow"] = follow
    assert got == {k: reference_greedy(model, ps[k], 8 if k == "follow" else 20) for k in ps}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_caching_off_finds_nothing_and_generates_the_same(qwen3_ckpt: tuple) -> None:
    path, _ = qwen3_ckpt
    ps = shared_prefix_prompts()
    arrivals = {0: [greedy("first", ps["first"], 12)], 3: [greedy("same", ps["same"], 12)]}
    on, on_cached = run(engine_for(path, block_size=16), arrivals)
    off, off_cached = run(engine_for(path, block_size=16, enable_prefix_caching=False),
                          arrivals)
    assert on == off
    assert on_cached["same"] == 32 and off_cached == {"first": None, "same": None}


def test_preempted_requests_find_their_own_blocks_again(qwen3_ckpt: tuple,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """Under block pressure sequences are preempted; admitted again, they take what of
    their own KV is still cached instead of recomputing it, and still match transformers."""
    path, model = qwen3_ckpt
    ps = prompts(seed=63, lengths=(20, 17, 25, 14))
    probe = engine_for(path, block_size=4)
    per_block = (probe.runner.kv.k[0][0].numel() * 2 * probe.model_config.num_layers * 4
                 * probe.dtype.itemsize)
    engine = engine_for(path, block_size=4, kv_cache_memory=per_block * 24,
                        max_num_batched_tokens=16)
    found: list[CachedPrefix] = []
    lookup = engine.block_manager.lookup

    def recording(seq: Sequence) -> CachedPrefix:
        cached = lookup(seq)
        if seq.num_output_tokens:  # a preempted sequence
            found.append(cached)
        return cached

    monkeypatch.setattr(engine.block_manager, "lookup", recording)
    got, _ = run(engine, {0: [greedy(f"r{i}", p, 24) for i, p in enumerate(ps)]})
    assert engine.scheduler.num_preemptions > 0 and any(c.num_tokens for c in found)
    assert got == {f"r{i}": reference_greedy(model, p, 24) for i, p in enumerate(ps)}


def test_prompt_logprobs_are_scored_whatever_the_cache_holds(qwen3_ckpt: tuple) -> None:
    """A request asking for prompt logprobs computes every prompt row (as vLLM, it takes
    nothing from the cache), and its scores equal transformers'."""
    path, model = qwen3_ckpt
    ps = shared_prefix_prompts()
    engine = engine_for(path, block_size=16)
    run(engine, {0: [greedy("first", ps["first"], 4)]})
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    assert engine.add(GenerateRequest("scored", ps["same"], params)) is None
    sent = [d for _ in range(20) for d in engine.step() if d.prompt_logprobs is not None]
    assert len(sent) == 1 and sent[0].num_cached_tokens == 0
    with torch.no_grad():
        ref = model(torch.tensor([ps["same"]])).logits[0].log_softmax(-1)
    want = ref[torch.arange(len(ps["same"]) - 1), torch.tensor(ps["same"][1:])]
    got = torch.tensor([e.logprob for e in sent[0].prompt_logprobs[1:]])
    assert (got - want).abs().max() < 1e-4


def test_a_cache_salt_keeps_requests_apart(qwen3_ckpt: tuple) -> None:
    path, _ = qwen3_ckpt
    prompt = shared_prefix_prompts()["first"]
    engine = engine_for(path, block_size=16)

    def salted(rid: str, salt: str | None) -> GenerateRequest:
        return GenerateRequest(rid, prompt, SamplingParams(max_tokens=2, temperature=0.0),
                               cache_salt=salt)

    _, cached = run(engine, {0: [salted("a", "tenant-a")], 6: [salted("b", "tenant-b")],
                             12: [salted("c", None)], 18: [salted("a2", "tenant-a")]})
    assert cached == {"a": 0, "b": 0, "c": 0, "a2": 32}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("size", "interleave"), [(2, 1), (2, 3)], ids=["d2", "d2-i3"])
def test_a_dcp_group_shares_prefixes_across_its_ranks(qwen3_ckpt: tuple, size: int,
                                                      interleave: int) -> None:
    """Spans cover whole blocks on every rank (W = lcm(block, I) x D tokens: 32 and 96
    here); a DCP group of real peer processes finds them and matches transformers."""
    from tests.support.engines import dcp_engine

    path, model = qwen3_ckpt
    system = prompts(seed=64, lengths=(100,))[0]
    tails = prompts(seed=65, lengths=(7, 3))
    ps = {"first": system + tails[0], "other": system + tails[1]}
    with dcp_engine(path, size, interleave) as engine:
        width = engine.block_manager.span
        got, cached = run(engine, {0: [greedy("first", ps["first"], 16)],
                                   12: [greedy("other", ps["other"], 16)]})
    assert width == (32 if interleave == 1 else 96)
    assert cached == {"first": 0, "other": 100 // width * width}
    assert got == {k: reference_greedy(model, p, 16) for k, p in ps.items()}


def test_the_flag_reaches_the_engine_and_serve_forwards_it(tmp_path: Path) -> None:
    import argparse

    from common.flags import as_flags
    from services.attention.config import add_engine_flags, from_args

    p = argparse.ArgumentParser()
    p.add_argument("--model")
    actions = add_engine_flags(p)
    for argv, on in (([], True), (["--no-enable-prefix-caching"], False),
                     (["--enable-prefix-caching"], True)):
        args = p.parse_args(["--model", str(tmp_path), *argv])
        assert from_args(args).enable_prefix_caching is on
        again = p.parse_args(["--model", str(tmp_path), *as_flags(args, actions)])
        assert again.enable_prefix_caching is on
