"""The log-sum-exp merge of sharded attention equals one full softmax attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp.merge import merge, partial_attention, reference_partial_attention


@settings(max_examples=300, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 3), kv_heads=st.sampled_from([1, 2]),
       groups=st.sampled_from([1, 2]), tq=st.integers(1, 6), length=st.integers(1, 24),
       shards=st.integers(1, 5), fused=st.booleans(), data=st.data())
def test_merged_shards_equal_full_softmax(seed: int, batch: int, kv_heads: int, groups: int,
                                          tq: int, length: int, shards: int, fused: bool,
                                          data: st.DataObject) -> None:
    attend = partial_attention if fused else reference_partial_attention
    g = torch.Generator().manual_seed(seed)
    heads, dim = kv_heads * groups, 8
    q = torch.randn(batch, heads, tq, dim, generator=g)
    k = torch.randn(batch, kv_heads, length, dim, generator=g)
    v = torch.randn(batch, kv_heads, length, dim, generator=g)
    mask_heads = data.draw(st.sampled_from([1, heads]))
    mask = torch.rand(batch, mask_heads, tq, length, generator=g) < 0.7
    mask[..., 0] = True  # every query sees a key (SDPA's reference needs one)
    # Any assignment of keys to shards, empty shards included.
    owner = torch.tensor(data.draw(st.lists(st.integers(0, shards - 1), min_size=length,
                                            max_size=length)))
    outs, lses = [], []
    for r in range(shards):
        keys = (owner == r).nonzero().flatten()
        out, lse = attend(q, k[:, :, keys], v[:, :, keys], mask[..., keys], dim**-0.5)
        outs.append(out)
        lses.append(lse)
    out, lse = merge(torch.stack(outs), torch.stack(lses))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    scores = (q @ k.repeat_interleave(groups, dim=1).transpose(-1, -2)) * dim**-0.5
    want_lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
    # 1e-6 relative to the largest value: float32 itself is ~6e-8 per operation; SDPA in
    # float32 is 2e-6 from a float64 truth on inputs twice this size.
    assert (out - want).abs().max() <= 1e-6 * max(1.0, want.abs().max().item())
    assert (lse - want_lse).abs().max() <= 1e-6 * max(1.0, want_lse.abs().max().item())


@pytest.mark.parametrize("attend", [partial_attention, reference_partial_attention])
def test_a_shard_without_visible_keys_contributes_nothing(attend: object) -> None:
    q = torch.randn(1, 2, 3, 4)
    k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    none = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    out, lse = attend(q, k, v, none, 0.5)  # type: ignore[operator]
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    empty_out, empty_lse = attend(q, k[:, :, :0], v[:, :, :0], none[..., :0], 0.5)  # type: ignore[operator]
    assert torch.equal(empty_out, torch.zeros_like(q)) and torch.isneginf(empty_lse).all()
    full = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    real_out, real_lse = attend(q, k, v, full, 0.5)  # type: ignore[operator]
    out, lse = merge(torch.stack([out, real_out, empty_out]),
                     torch.stack([lse, real_lse, empty_lse]))
    assert torch.equal(out, real_out) and torch.equal(lse, real_lse)
