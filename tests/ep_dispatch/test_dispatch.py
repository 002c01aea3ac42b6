"""Dispatch layout and combine against a pure-torch reference, for random routings."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ep_dispatch.layout import ReplicaTurns, combine, compute_layout
from ep_dispatch.local import LocalExperts
from ep_dispatch.placement import Placement, PlacementError, make_placement
from ep_dispatch.registry import MoESeam, create_experts_client

H = 8


@st.composite
def routings(draw: st.DrawFn) -> tuple[Placement, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_experts = draw(st.integers(1, 12))
    num_ranks = draw(st.integers(1, 5))
    top_k = draw(st.integers(1, min(8, num_experts)))
    tokens = draw(st.integers(0, 40))
    # Random placement, every expert on 1..num_ranks ranks (replicas included).
    experts = tuple(tuple(sorted(draw(st.sets(st.integers(0, num_ranks - 1), min_size=1))))
                    for _ in range(num_experts))
    placement = Placement(num_ranks, num_experts, {0: experts})
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    skew = draw(st.booleans())  # all tokens to the same experts
    scores = torch.rand(tokens, num_experts, generator=g)
    if skew:
        scores[:, :top_k] += 10
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g)
    x = torch.randn(tokens, H, generator=g)
    return placement, x, ids, weights


def reference(placement: Placement, ids: torch.Tensor) -> tuple[list[int], list[list[int]]]:
    """Rows per rank and per local expert, counted one (token, choice) at a time."""
    rank_counts = [0] * placement.num_ranks
    local = placement.local_experts
    expert_counts = [[0] * len(local(r)[0]) for r in range(placement.num_ranks)]
    for t, row in enumerate(ids.tolist()):
        for e in row:
            replicas = placement.replicas[0][e]
            rank = replicas[t % len(replicas)]
            rank_counts[rank] += 1
            expert_counts[rank][local(rank)[0].index(e)] += 1
    return rank_counts, expert_counts


@settings(max_examples=300, deadline=None)
@given(routings())
def test_layout_matches_reference_and_rows_trace_back(case: tuple) -> None:
    placement, _, ids, weights = case
    layout = compute_layout(ids, weights, placement, 0)
    assert (layout.rank_counts, layout.expert_counts) == reference(placement, ids)
    # Every sent row is a (token, choice) of the input, each exactly once, to an expert
    # its rank holds, grouped by rank then local expert.
    seen = set()
    start = 0
    for rank, counts in enumerate(layout.expert_counts):
        held = placement.local_experts(rank)[0]
        for i, n in enumerate(counts):
            for row in range(start, start + n):
                t = int(layout.src_token[row])
                choices = (ids[t] == held[i]).nonzero().flatten().tolist()
                assert len(choices) == 1
                assert float(layout.weights[row]) == float(weights[t, choices[0]])
                seen.add((t, choices[0]))
            start += n
    assert len(seen) == ids.numel()


@settings(max_examples=200, deadline=None)
@given(routings())
def test_combine_is_the_router_weighted_sum(case: tuple) -> None:
    placement, x, ids, weights = case
    layout = compute_layout(ids, weights, placement, 0)
    # A fake expert e multiplies its rows by (e + 1): y[r] = (expert(r) + 1) * x[src(r)].
    expert_of_row = torch.cat([
        torch.tensor(placement.local_experts(rank)[0])[i].repeat(n)
        for rank, counts in enumerate(layout.expert_counts) for i, n in enumerate(counts)
    ] or [torch.zeros(0, dtype=torch.int64)])
    y = x[layout.src_token] * (expert_of_row + 1)[:, None]
    want = (weights[..., None] * (ids + 1)[..., None] * x[:, None, :]).sum(dim=1)
    assert torch.allclose(combine(y, layout), want, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(routings())
def test_the_local_layout_groups_by_expert(case: tuple) -> None:
    placement, x, ids, weights = case
    layout = LocalExperts(placement.num_experts, lambda *_: x).layout(ids, weights)
    counts = layout.expert_counts[0]
    assert counts == torch.bincount(ids.flatten(), minlength=placement.num_experts).tolist()
    assert layout.rank_counts == [ids.numel()]
    assert layout.counts[0].tolist() == counts  # the device copy a CUDA graph reads
    owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    y = x[layout.src_token] * (owner + 1)[:, None]
    want = (weights[..., None] * (ids + 1)[..., None] * x[:, None, :]).sum(dim=1)
    assert torch.allclose(combine(y, layout), want, atol=1e-6)


def test_a_rank_that_receives_nothing_and_zero_tokens() -> None:
    placement = Placement(3, 4, {0: ((0,), (0,), (1,), (1,))})  # rank 2 holds nothing
    ids = torch.tensor([[0, 2], [1, 3]])
    layout = compute_layout(ids, torch.ones(2, 2), placement, 0)
    assert layout.rank_counts == [2, 2, 0] and layout.expert_counts[2] == []
    empty = compute_layout(ids[:0], torch.ones(0, 2), placement, 0)
    assert empty.rank_counts == [0, 0, 0]
    assert combine(torch.zeros(0, H), empty).shape == (0, H)


def test_replicas_share_an_experts_tokens() -> None:
    placement = Placement(2, 2, {0: ((0, 1), (0,))})
    ids = torch.zeros(10, 1, dtype=torch.int64)  # every token to expert 0
    assert compute_layout(ids, torch.ones(10, 1), placement, 0).rank_counts == [5, 5]


def test_balanced_placement_and_file_errors(tmp_path: object) -> None:
    p = Placement.balanced([0, 1], 8, 3)
    assert [len(p.local_experts(r)[0]) for r in range(3)] == [3, 3, 2]
    again = Placement.from_json(p.to_json(), [0, 1], 8)
    assert again == p
    raw = json.loads(p.to_json())
    raw["layers"]["0"][7] = []
    with pytest.raises(PlacementError, match="layer 0 expert 7 is unplaced"):
        Placement.from_json(json.dumps(raw), [0, 1], 8)
    raw["layers"]["0"][7] = [5]
    with pytest.raises(PlacementError, match=r"layer 0 expert 7 on rank\(s\) \[5\]"):
        Placement.from_json(json.dumps(raw), [0, 1], 8)
    del raw["layers"]["1"]
    with pytest.raises(PlacementError, match=r"covers layers \[0\]"):
        Placement.from_json(json.dumps(raw), [0, 1], 8)
    path = tmp_path / "p.json"  # type: ignore[operator]
    path.write_text(p.to_json())
    with pytest.raises(PlacementError, match="places experts on 3 ranks, but there are 2"):
        make_placement([0, 1], 8, 2, path)
    with pytest.raises(PlacementError, match="give it or --expert-replicas, not both"):
        make_placement([0, 1], 8, 3, path, replicas=2)


@pytest.mark.parametrize(("ranks", "replicas"), [(3, 2), (4, 3), (5, 5), (2, 1)])
def test_balanced_replicas_and_a_lost_rank(ranks: int, replicas: int) -> None:
    """Each expert on `replicas` distinct ranks, ranks within one expert of each other;
    without any one rank (`excluding`), every expert keeps a replica exactly when there
    were two, and the other ranks keep their experts in their order."""
    p = Placement.balanced([0, 2], 10, ranks, replicas)
    assert all(len(set(r)) == replicas for r in p.replicas[0])
    held = [len(p.local_experts(r)[0]) for r in range(ranks)]
    assert max(held) - min(held) <= 1 and sum(held) == 10 * replicas
    for lost in range(ranks):
        rest = p.excluding(frozenset({lost}))
        assert (rest is not None) == (replicas > 1)
        if rest is not None:
            assert rest.local_experts(lost) == {0: [], 2: []}
            assert all(rest.local_experts(r) == p.local_experts(r)
                       for r in range(ranks) if r != lost)
            ids = torch.arange(10).repeat(3)[:, None]  # every expert, 3 tokens each
            assert compute_layout(ids, torch.ones(30, 1), rest, 0).rank_counts[lost] == 0
    with pytest.raises(PlacementError, match=rf"--expert-replicas must be 1..{ranks}"):
        Placement.balanced([0], 10, ranks, ranks + 1)


def test_unknown_backend_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown dispatch backend 'nope'; available: deepep, "
                                         r"local, nccl, rpc, torch$"):
        create_experts_client("nope", MoESeam(moe_layers=[0], num_experts=2))


def test_local_experts_client_equals_dense_reference() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, H, H, generator=g)

    def expert_fn(layer: int, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return torch.cat([xe @ w[e] for e, xe in enumerate(x.split(counts))])

    x = torch.randn(6, H, generator=g)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [0, 2], [1, 3]])
    weights = torch.rand(6, 2, generator=g)
    got = LocalExperts(4, expert_fn)(0, x, ids, weights)
    want = torch.stack([sum(weights[t, k] * (x[t] @ w[ids[t, k]]) for k in range(2))
                        for t in range(6)])
    assert torch.allclose(got, want, atol=1e-6)


def test_routing_tables_are_copied_to_a_device_once() -> None:
    """Layouts are planned where the top-k ids live: each layer's tables are copied there
    once (the meta device stands in for a GPU) and the CPU ones are the originals."""
    placement = Placement.balanced([0, 2], 8, 3)
    meta = torch.device("meta")
    table = placement.table(2, meta)
    assert table.replica_ranks.device == meta and table.local_index.device == meta
    assert placement.table(2, meta) is table and placement.table(0, meta) is not table
    assert placement.table(2, torch.device("cpu")) is placement.table(2)
    assert table.num_local == placement.table(2).num_local == [3, 3, 2]


def test_the_first_replica_rotates_so_single_token_steps_spread() -> None:
    """Decode steps of one token through 2 MoE layers, each with expert 0 on both ranks:
    every layer's calls alternate between the replicas (one counter shared by the layers
    gave each layer the same replica every step), and within a call tokens alternate."""
    placement = Placement(2, 2, {0: ((0, 1), (0,)), 1: ((0, 1), (1,))})
    turns = ReplicaTurns()
    one = torch.zeros(1, 1, dtype=torch.int64)
    served: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(4):  # steps
        for layer in (0, 1):
            counts = compute_layout(one, torch.ones(1, 1), placement, layer,
                                    turns(layer)).rank_counts
            served[layer].append(counts.index(1))
    assert served == {0: [0, 1, 0, 1], 1: [0, 1, 0, 1]}
    rank_1 = ReplicaTurns(start=1)  # attention rank 1 starts a turn apart from rank 0
    assert [rank_1(0), rank_1(0), rank_1(1)] == [1, 2, 1]
    ids = torch.zeros(10, 1, dtype=torch.int64)
    assert compute_layout(ids, torch.ones(10, 1), placement, 0, 3).rank_counts == [5, 5]


def test_combine_rounds_a_tokens_sum_once() -> None:
    """bf16 expert outputs, top-8: each token's weighted sum is rounded to bf16 once, from
    float32 (DeepEP's combine), not after each of its 8 additions."""
    from ep_dispatch.layout import Layout

    g = torch.Generator().manual_seed(0)
    tokens, top_k, hidden = 64, 8, 64
    y = torch.randn(tokens * top_k, hidden, generator=g).bfloat16()  # [N, H]
    weights = torch.rand(tokens * top_k, generator=g)  # [N]
    src = torch.randperm(tokens * top_k, generator=g) // top_k  # [N]
    exact = torch.zeros(tokens, hidden, dtype=torch.float64).index_add_(
        0, src, y.double() * weights.double()[:, None])  # [T, H]
    want = exact.to(torch.bfloat16)  # one rounding (float64 -> bf16 directly)
    layout = Layout(src, weights, torch.tensor([[tokens * top_k]]), [1], tokens)
    got = combine(y, layout)  # every backend's combine, `local`'s included
    assert got.dtype == torch.bfloat16
    mismatched = (got != want).float().mean().item()
    assert mismatched < 1e-3, mismatched  # float32's own error decides a rare tie


def test_the_compiled_combine_is_torchs() -> None:
    """Float32 on the CPU, combine is one compiled call: the same sums as `index_add_` in
    the same order, and a row outside the tokens is refused, not written out of bounds."""
    from ep_dispatch.layout import Layout
    from moe_kernels import cpu_kernels

    g = torch.Generator().manual_seed(1)
    tokens, top_k, hidden = 9, 4, 96
    y = torch.randn(tokens * top_k, 2 * hidden, generator=g)[:, :hidden]  # strided rows
    weights = torch.rand(tokens * top_k, generator=g)
    src = torch.randperm(tokens * top_k, generator=g) // top_k
    layout = Layout(src, weights, torch.tensor([[tokens * top_k]]), [1], tokens)
    got = combine(y, layout)
    cpu_kernels.set_enabled(False)
    try:
        want = combine(y, layout)  # torch's index_add_
    finally:
        cpu_kernels.set_enabled(True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    kernels = cpu_kernels.cpu_kernels()
    assert kernels is not None
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.combine_f32(y, src + tokens, weights, tokens)
