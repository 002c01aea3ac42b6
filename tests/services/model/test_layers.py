"""The layer math (`services.model.layers`) against transformers' own Qwen3-MoE modules:
RMSNorm, and q/k per-head RMSNorm + rotary embedding from the stacked qkv projection,
through the compiled CPU kernels (float32 on the CPU) and through torch's path."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from moe_kernels import cpu_kernels
from services.model.layers import qkv_heads, rms_norm, rope_cos_sin

if TYPE_CHECKING:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
# transformers' modeling modules are imported in the tests, not here: they import triton,
# which must first see test_triton_mxfp4's TRITON_INTERPRET where a worker runs both


@pytest.fixture(params=["kernels", "torch"])
def path(request: pytest.FixtureRequest) -> object:
    cpu_kernels.set_enabled(request.param == "kernels")
    if request.param == "kernels" and cpu_kernels.cpu_kernels() is None:
        pytest.fail("the CPU kernels did not build on this machine")
    yield request.param
    cpu_kernels.set_enabled(True)


def hf_norm(weight: torch.Tensor, eps: float) -> Qwen3MoeRMSNorm:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    norm = Qwen3MoeRMSNorm(weight.numel(), eps)
    norm.weight.data.copy_(weight)
    return norm


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_rms_norm_is_transformers(path: object, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=g) * 3, torch.randn(96, generator=g)
    want = hf_norm(w, 1e-6)(x)
    torch.testing.assert_close(rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-6)
    wide = torch.randn(rows, 200, generator=g)[:, 7:103]  # strided rows
    torch.testing.assert_close(rms_norm(wide, w, 1e-6), hf_norm(w, 1e-6)(wide),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qk_norm", [True, False])  # Qwen3, Mixtral
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim"),
                         [(1, 4, 2, 64), (7, 8, 8, 32), (33, 16, 4, 128)])
def test_qkv_heads_are_transformers(path: object, qk_norm: bool, tokens: int, heads: int,
                                    kv_heads: int, head_dim: int) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(tokens * heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    q_w, k_w = torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g)
    positions = torch.randint(0, 4000, (tokens,), generator=g)
    cos, sin = rope_cos_sin(positions, head_dim, 1e6, torch.float32)
    q, k, v = qkv_heads(qkv, q_w if qk_norm else None, k_w if qk_norm else None, cos, sin,
                        heads, kv_heads, 1e-6)
    # transformers: q_norm(q_proj(x).view(..)).transpose(1, 2), then apply_rotary_pos_emb
    hq = qkv[:, :heads * head_dim].view(1, tokens, heads, head_dim)
    hk = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(1, tokens, kv_heads,
                                                                      head_dim)
    if qk_norm:
        hq, hk = hf_norm(q_w, 1e-6)(hq), hf_norm(k_w, 1e-6)(hk)
    want_q, want_k = apply_rotary_pos_emb(hq.transpose(1, 2), hk.transpose(1, 2), cos[None],
                                          sin[None])
    torch.testing.assert_close(q, want_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
    assert torch.equal(v, qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads,
                                                                       head_dim))


def test_the_kernels_refuse_bad_shapes_with_their_reason() -> None:
    kernels = cpu_kernels.cpu_kernels()
    assert kernels is not None
    cos = sin = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="not \\(heads \\+ 2 kv\\) x D"):
        kernels.qk_norm_rope_f32(torch.zeros(2, 100), None, None, cos, sin, 1, 1, 1e-6)
    with pytest.raises(RuntimeError, match="both norms or neither"):
        kernels.qk_norm_rope_f32(torch.zeros(2, 192), torch.ones(64), None, cos, sin, 1, 1,
                                 1e-6)
    with pytest.raises(RuntimeError, match="float32 \\[H\\]"):
        kernels.rms_norm_f32(torch.zeros(2, 64), torch.ones(32), 1e-6)
