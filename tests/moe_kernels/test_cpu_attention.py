"""The compiled CPU decode attention (`moe_kernels/csrc/attention_cpu.cpp`) against a full
softmax (`dcp.merge.reference_partial_attention`): grouped KV heads, keys scattered over
the cache, padded and windowed masks, a sequence with no visible key (a DCP shard's), and
bad slots refused. (Every logits-parity test against transformers runs the engine's decodes
through it on the CPU.)"""

from __future__ import annotations

import pytest
import torch

from dcp.merge import reference_partial_attention
from moe_kernels.selection import cpu_decode_attention

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(("batch", "heads", "kv_heads", "dim", "length"), [
    (1, 4, 4, 16, 1),  # one key, no grouping
    (5, 16, 4, 64, 37),  # the mid checkpoint's heads
    (3, 8, 1, 128, 300),  # one KV head for all (MQA)
    (1, 16, 4, 64, 129),  # one chat's decode: its KV heads split over the threads
    (1, 16, 1, 96, 70),  # ... with one KV head (MLA's): its query heads split
])
def test_it_equals_a_full_softmax(kernel: object, batch: int, heads: int, kv_heads: int,
                                  dim: int, length: int) -> None:
    g = torch.Generator().manual_seed(batch * length)
    slots_in_cache = 4 * batch * length + 8
    k_cache = torch.randn(slots_in_cache, kv_heads, dim, generator=g)
    v_cache = torch.randn(slots_in_cache, kv_heads, dim, generator=g)
    slots = torch.randperm(slots_in_cache, generator=g)[:batch * length].view(batch, length)
    mask = torch.rand(batch, length, generator=g) < 0.8
    mask[:, 0] = True  # every decode sees a key (its own)
    mask[-1, length // 2:] = False  # a shorter sequence's padding
    slots[-1, length // 2:] = 0  # pointing at slot 0, as the batch pads
    q = torch.randn(batch, heads, dim, generator=g)
    scale = dim**-0.5
    got = cpu_decode_attention(q, k_cache, v_cache, slots, mask, scale)
    assert got is not None
    k = k_cache[slots].transpose(1, 2)  # [B, KVH, L, D]
    v = v_cache[slots].transpose(1, 2)
    want = reference_partial_attention(q[:, :, None], k, v, mask[:, None, None], scale)
    torch.testing.assert_close(got[0], want[0][:, :, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1][:, :, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_splitting_a_sequences_heads_over_threads_changes_no_bit(kernel: object,
                                                                 kv_heads: int) -> None:
    """One sequence on 1 thread (whole) and on 2 (its heads split): the same bits."""
    g = torch.Generator().manual_seed(kv_heads)
    k_cache, v_cache = torch.randn(2, 64, kv_heads, 64, generator=g)
    slots, mask = torch.arange(50)[None], torch.ones(1, 50, dtype=torch.bool)
    q = torch.randn(1, 16, 64, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = cpu_decode_attention(q, k_cache, v_cache, slots, mask, 0.125)
        torch.set_num_threads(2)
        split = cpu_decode_attention(q, k_cache, v_cache, slots, mask, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert whole is not None and split is not None
    assert torch.equal(whole[0], split[0]) and torch.equal(whole[1], split[1])


def test_a_sequence_with_no_visible_key_gets_zero_and_minus_inf(kernel: object) -> None:
    k_cache, v_cache = torch.randn(10, 2, 32), torch.randn(10, 2, 32)
    slots = torch.tensor([[1, 2, 3], [4, 5, 6]])
    mask = torch.tensor([[True, False, True], [False, False, False]])
    got = cpu_decode_attention(torch.randn(2, 4, 32), k_cache, v_cache, slots, mask, 0.2)
    assert got is not None
    out, lse = got
    assert out[1].eq(0).all() and lse[1].eq(float("-inf")).all()
    assert lse[0].isfinite().all()


def test_bad_slots_and_shapes_are_refused(kernel: object) -> None:
    k_cache, v_cache = torch.randn(10, 2, 32), torch.randn(10, 2, 32)
    q, mask = torch.randn(1, 4, 32), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="out of the cache"):
        kernel.decode_attention(q, k_cache, v_cache, torch.tensor([[1, 10]]), mask, 1.0)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="q \\[B, H, D\\]"):
        kernel.decode_attention(torch.randn(1, 3, 32), k_cache, v_cache,  # type: ignore[attr-defined]
                                torch.tensor([[1, 2]]), mask, 1.0)
    assert cpu_decode_attention(q.double(), k_cache.double(), v_cache.double(),
                                torch.tensor([[1, 2]]), mask, 1.0) is None  # the torch path
