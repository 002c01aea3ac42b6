"""Multi-head latent attention (DeepSeek-V2/V3) over a cache of latents.

Each token caches, per layer, one row [kv_lora_rank + qk_rope_head_dim]: the normalised
latent c and the rotated key k_pe, shared by all heads. With the absorbed projections
(DeepSeek-V2's paper, vLLM's MLA backends), attention runs on those rows as one KV head:

    q_h = [q_nope_h W_UK_h, q_pe_h]             # [kv_lora + rope], W_UK_h: kv_b's key rows
    score(h, j) = q_h . [c_j, k_pe_j] * scale   # = q_nope_h . k_nope_hj + q_pe_h . k_pe_j
    o_h = (sum_j p_hj c_j) W_UV_h^T             # = sum_j p_hj v_hj

The values are the rows' first kv_lora_rank dims: the attention reads each row once, as
its key and its value (as FlashMLA does), and drops the output's rotary dims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_kernels.cpu_kernels import cpu_kernels
from moe_kernels.panels import PanelWeights
from moe_kernels.selection import linear
from moe_kernels.selection import panels_for_cpu as _panels
from services.model.config import ModelConfig
from services.model.layers import apply_rope, rms_norm

Weight = torch.Tensor | PanelWeights


@dataclass(frozen=True)
class MLAWeights:
    """One layer's MLA projections (linears as [out, in])."""

    qkv_a: Weight  # [Q + kv_lora + rope, H]: q_a_proj (Q = q_lora_rank) or q_proj (Q =
    #                heads * qk_head_dim), stacked on kv_a_proj_with_mqa: one pass over x
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: Weight | None  # [heads * qk_head_dim, q_lora_rank]
    kv_a_norm: torch.Tensor  # [kv_lora]
    w_uk: Weight  # [heads, kv_lora, qk_nope]: kv_b_proj's key rows (transposed), folded into q
    w_uv: Weight  # [heads, v_head, kv_lora]: kv_b_proj's value rows


def load_mla(get: Callable[..., torch.Tensor], cfg: ModelConfig) -> MLAWeights:
    """Layer weights by `get(name under the layer, *shape)`."""
    m, heads, h = cfg.mla, cfg.num_heads, cfg.hidden_size
    assert m is not None
    first = get("self_attn.q_a_proj.weight", m.q_lora_rank, h) if m.q_lora_rank \
        else get("self_attn.q_proj.weight", heads * m.qk_head_dim, h)
    kv_a = get("self_attn.kv_a_proj_with_mqa.weight", m.kv_lora_rank + m.qk_rope_head_dim, h)
    kv_b = get("self_attn.kv_b_proj.weight", heads * (m.qk_nope_head_dim + m.v_head_dim),
               m.kv_lora_rank).view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    return MLAWeights(
        qkv_a=_panels(torch.cat([first, kv_a]), pad=True),
        q_a_norm=get("self_attn.q_a_layernorm.weight", m.q_lora_rank) if m.q_lora_rank
        else None,
        q_b=_panels(get("self_attn.q_b_proj.weight", heads * m.qk_head_dim, m.q_lora_rank),
                    pad=True) if m.q_lora_rank else None,
        kv_a_norm=get("self_attn.kv_a_layernorm.weight", m.kv_lora_rank),
        w_uk=_panels(kv_b[:, : m.qk_nope_head_dim].transpose(1, 2).contiguous()),
        w_uv=_panels(kv_b[:, m.qk_nope_head_dim:].contiguous()),
    )


def mla_queries(cfg: ModelConfig, w: MLAWeights, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed queries [T, heads, kv_lora + rope] and the tokens' cache rows
    [T, 1, kv_lora + rope] for x [T, H] (the input-normed hidden states), rotated by
    cos/sin [T, rope]."""
    m, t, eps = cfg.mla, x.shape[0], cfg.rms_norm_eps
    assert m is not None
    a = linear(x, w.qkv_a)  # [T, Q + kv_lora + rope]
    split = m.q_lora_rank or cfg.num_heads * m.qk_head_dim
    q = a[:, :split]
    if w.q_b is not None:
        q = linear(rms_norm(q, w.q_a_norm, eps), w.q_b)  # type: ignore[arg-type]
    q = q.reshape(t, cfg.num_heads, m.qk_head_dim)
    latent = rms_norm(a[:, split:split + m.kv_lora_rank], w.kv_a_norm, eps)  # [T, C]
    k_pe = _rope(a[:, None, split + m.kv_lora_rank:], cos, sin, m.rope_interleave)
    q_pe = _rope(q[..., m.qk_nope_head_dim:], cos, sin, m.rope_interleave)  # [T, heads, R]
    q_latent = head_linear(q[..., : m.qk_nope_head_dim], w.w_uk)  # [T, heads, C]
    queries = torch.cat([q_latent, q_pe], dim=-1)  # [T, heads, C + rope]
    return queries, torch.cat([latent[:, None], k_pe], dim=-1)  # [T, 1, C + rope]


def mla_values(cfg: ModelConfig, w: MLAWeights, out: torch.Tensor) -> torch.Tensor:
    """The heads' values [T, heads * v_head] from the attention's output over cache rows
    out [T, heads, kv_lora + rope] (its rotary dims dropped)."""
    m, t = cfg.mla, out.shape[0]
    assert m is not None
    return head_linear(out[..., : m.kv_lora_rank], w.w_uv).reshape(t, -1)  # [T, heads * V]


def head_linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [T, heads, K] through one matrix per head, w [heads, N, K] -> [T, heads, N]: the
    compiled kernel where w is in panels (and x float32 on the CPU), else torch's bmm."""
    if isinstance(w, PanelWeights) and x.dtype == torch.float32 and x.stride(-1) == 1 \
            and (kernels := cpu_kernels()) is not None:
        return kernels.head_linear_f32(x, w.panels)
    w = w.unpack() if isinstance(w, PanelWeights) else w
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
          ) -> torch.Tensor:
    """`apply_rope` of x [T, n, R]; the compiled kernel's on the CPU in float32 (the one
    the compiled block runs: the same bits)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1 \
            and cos.dtype == torch.float32 and (kernels := cpu_kernels()) is not None:
        return kernels.rope_f32(x, cos.contiguous(), sin.contiguous(), interleaved)
    return apply_rope(x, cos, sin, interleaved)
