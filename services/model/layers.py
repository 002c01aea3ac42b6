"""Layer math shared by the attention and expert services, as pure functions on tensors.

On the CPU in float32 they run the compiled kernels (`moe_kernels.cpu_kernels`), one call
each instead of 6 to 24 tensor operations. Elsewhere they run torch's operations, which the
kernels match within float32 rounding.
"""

from __future__ import annotations

import math

import torch

from moe_kernels.cpu_kernels import cpu_kernels
from services.model.families import Rope, yarn_mscale


def _kernels_for(x: torch.Tensor) -> object | None:
    """The compiled CPU kernels, where they take x: 2-D float32 rows on the CPU."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        return None
    return cpu_kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., H] with weight [H] over the last dim, computed in float32 as
    transformers does. Returns [..., H] in x's dtype (times the weight's)."""
    if weight.dtype == torch.float32 and (kernels := _kernels_for(x)) is not None:
        return kernels.rms_norm_f32(x, weight, eps)  # type: ignore[attr-defined]
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_inv_freq(rope: Rope, dim: int, device: torch.device | str = "cpu"
                  ) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies [dim / 2] float32, and the factor that cos and sin
    are scaled by: 1, or YaRN's attention factor. This follows transformers' rope init
    functions."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    if rope.kind == "default":
        return 1.0 / (rope.theta ** exponents), 1.0
    pos_freqs = rope.theta ** exponents
    factor = rope.factor
    attention = rope.attention_factor
    if attention is None:
        attention = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim) \
            if rope.mscale and rope.mscale_all_dim else yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings
                              / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as in transformers, to avoid dividing by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low)
            / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # [dim / 2]: 1 where a dim keeps its frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) \
        + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
    rope: Rope | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for `positions` [T] -> two [T, head_dim] tensors, computed in
    float32. They are the default rotary of `theta`, or `rope`'s, with YaRN's scaled
    frequencies and factor."""
    inv_freq, scale = rope_inv_freq(rope or Rope(theta), head_dim, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool = False) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by the per-token tables cos/sin [T, head_dim].

    By default it rotates halves (x_i, x_{i + D/2}). Where `interleaved`, DeepSeek's layout,
    it rotates pairs (x_{2i}, x_{2i+1}), and the output holds the pairs' first parts, then
    their second parts, as transformers' `apply_rotary_pos_emb_interleave` does. Scores are
    the same either way.
    """
    if interleaved:
        c, s = cos[:, None, : cos.shape[-1] // 2], sin[:, None, : sin.shape[-1] // 2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def qkv_heads(
    qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
    cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention's q [T, heads, D], k and v [T, kv_heads, D] from the stacked
    projection qkv [T, (heads + 2 kv_heads) D]. q and k are RMSNorm'd per head, by Qwen3's
    q_norm/k_norm [D] where given, and rotated by cos/sin [T, D]."""
    t, d = qkv.shape[0], cos.shape[-1]
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    if cos.dtype == torch.float32 and (kernels := _kernels_for(qkv)) is not None:
        q, k = kernels.qk_norm_rope_f32(  # type: ignore[attr-defined]
            qkv, q_norm, k_norm, cos.contiguous(), sin.contiguous(), heads, kv_heads, eps)
        return q, k, v
    q = qkv[:, :heads * d].view(t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
