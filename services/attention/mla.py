"""Multi-head latent attention (DeepSeek-V2/V3) over a cache of latents.

Each token caches, per layer, one row [kv_lora_rank + qk_rope_head_dim]: the normalised
latent c and the rotated key k_pe, shared by all heads. With the absorbed projections, from
DeepSeek-V2's paper and vLLM's MLA backends, attention runs on those rows as one KV head:

    q_h = [q_nope_h W_UK_h, q_pe_h]             # [kv_lora + rope], W_UK_h: kv_b's key rows
    score(h, j) = q_h . [c_j, k_pe_j] * scale   # = q_nope_h . k_nope_hj + q_pe_h . k_pe_j
    o_h = (sum_j p_hj c_j) W_UV_h^T             # = sum_j p_hj v_hj

The values are the rows' first kv_lora_rank dims. As in FlashMLA, the attention reads each
row once, as both its key and its value, and drops the output's rotary dims.

The paged cache holds that row per token and layer. With `mla`, `KVCache` keeps one tensor a
layer that is both K and V, and `ModelConfig.kv_elements_per_token` sizes the blocks. Decode
runs absorbed, as above, then applies W_UV; the existing paged decode kernel does the
attention, reading each row once for all heads. Prefill chunks expand their context's keys
and values from the latents with kv_b_proj, and attend with the queries as they are
(`MLACache`), as DeepSeek's and vLLM's prefill do. That takes qk_head_dim + v_head_dim
products per (query, key) pair instead of 2 (kv_lora_rank + rope). Both forms give the
log-sum-exp, so a DCP rank attends over its shard of the latent rows, with the same
interleaving as every cache, and the group merges the partial values in V's dims. On the CPU
a decode step's MLA block is one compiled call a layer (`mla_block_f32`), with the same bits
as the Python path. DeepSeek's multi-token-prediction layer drafts for speculative decoding
(`spec_decode.mtp`). Without MTP drafts, its attention weights stay unread, and one log line
says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from dcp.batch import StepBatch
from dcp.merge import partial_attention, reference_partial_attention
from moe_kernels.cpu_kernels import cpu_kernels
from moe_kernels.int8 import Int8Panels, dequantized_activations
from moe_kernels.panels import PanelWeights
from moe_kernels.selection import DenseWeight, cpu_decode_attention, linear
from services.attention.kv_cache import Kernel, KVCache, sdpa
from services.attention.weights import WeightReader
from services.model.config import ModelConfig
from services.model.layers import apply_rope, rms_norm

Weight = DenseWeight
Panels = PanelWeights | Int8Panels  # the layouts the compiled blocks read


@dataclass(frozen=True)
class MLAWeights:
    """One layer's MLA projections, with linears as [out, in]."""

    qkv_a: Weight  # [Q + kv_lora + rope, H]: q_a_proj (Q = q_lora_rank) or q_proj (Q =
    #                heads * qk_head_dim), stacked on kv_a_proj_with_mqa: one pass over x
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: Weight | None  # [heads * qk_head_dim, q_lora_rank]
    kv_a_norm: torch.Tensor  # [kv_lora]
    w_uk: Weight  # [heads, kv_lora, qk_nope]: kv_b_proj's key rows (transposed), folded into q
    w_uv: Weight  # [heads, v_head, kv_lora]: kv_b_proj's value rows
    kv_b: Weight  # [heads (qk_nope + v_head), kv_lora]: kv_b_proj, to expand prefill's keys


def load_mla(read: WeightReader, p: str, cfg: ModelConfig) -> MLAWeights:
    """Layer `p`'s MLA weights, where `p` is "model.layers.{i}".

    The absorbed W_UK and W_UV are cut from kv_b_proj as read in the model's dtype, and then
    laid out on their own. Their output channels are not kv_b's rows, since W_UK is
    transposed, so a stored int8 kv_b's scales would not be theirs. `switchyard quantize`
    leaves kv_b float.
    """
    m, heads, h = cfg.mla, cfg.num_heads, cfg.hidden_size
    assert m is not None
    first = ("self_attn.q_a_proj.weight", m.q_lora_rank, h) if m.q_lora_rank \
        else ("self_attn.q_proj.weight", heads * m.qk_head_dim, h)
    kv_a = ("self_attn.kv_a_proj_with_mqa.weight", m.kv_lora_rank + m.qk_rope_head_dim, h)
    kv_b = read.get(f"{p}.self_attn.kv_b_proj.weight",
                    heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank
                    ).view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    return MLAWeights(
        qkv_a=read.linear(*((f"{p}.{name}", n, k) for name, n, k in (first, kv_a))),
        q_a_norm=read.get(f"{p}.self_attn.q_a_layernorm.weight", m.q_lora_rank)
        if m.q_lora_rank else None,
        q_b=read.linear((f"{p}.self_attn.q_b_proj.weight", heads * m.qk_head_dim,
                         m.q_lora_rank)) if m.q_lora_rank else None,
        kv_a_norm=read.get(f"{p}.self_attn.kv_a_layernorm.weight", m.kv_lora_rank),
        w_uk=read.layout(kv_b[:, : m.qk_nope_head_dim].transpose(1, 2).contiguous()),
        w_uv=read.layout(kv_b[:, m.qk_nope_head_dim:].contiguous()),
        kv_b=read.layout(kv_b.reshape(-1, m.kv_lora_rank)),
    )


@dataclass(frozen=True)
class MLAQueries:
    """A step's queries, split as the two forms of MLA attention take them."""

    nope: torch.Tensor  # [T, heads, qk_nope]
    pe: torch.Tensor  # [T, heads, rope], rotated


def mla_queries(cfg: ModelConfig, w: MLAWeights, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[MLAQueries, torch.Tensor]:
    """The queries, and the tokens' cache rows [T, 1, kv_lora + rope], for x [T, H], the
    input-normed hidden states. Both are rotated by cos/sin [T, rope]."""
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
    rows = torch.cat([latent[:, None], k_pe], dim=-1)  # [T, 1, C + rope]
    return MLAQueries(q[..., : m.qk_nope_head_dim], q_pe), rows


class MLACache:
    """One layer's latent cache as MLA attends over it, giving values [T, heads, V].

    - Decode rows: the absorbed queries [q_nope W_UK, q_pe] over the latent rows, read in
      place as one KV head whose values are the rows' latents, then W_UV.
    - Prefill chunks: keys [k_nope, k_pe] and values expanded from their context's
      latents by kv_b_proj, with the queries as they are. This is DeepSeek's and vLLM's
      prefill: qk_head_dim + v_head_dim products per (query, key) pair, not
      2 (kv_lora + rope).

    Both forms give the softmax's log-sum-exp too, so a DCP rank's partial results over
    its shard merge as any attention's (`dcp.merge`), in V's dims.
    """

    def __init__(self, kv: KVCache, cfg: ModelConfig, w: MLAWeights) -> None:
        assert cfg.mla is not None
        self.kv, self.cfg, self.mla, self.w = kv, cfg, cfg.mla, w

    def attend(self, layer: int, q: MLAQueries, batch: StepBatch) -> torch.Tensor:
        """Attention over every key of this cache, giving values [T, heads, V]. Off the CPU
        it runs on torch's SDPA, which needs no log-sum-exp."""
        return self._attend(layer, q, batch, sdpa if q.nope.device.type != "cpu" else None)[0]

    def attend_partial(self, layer: int, q: MLAQueries, batch: StepBatch
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [T, heads, V], lse [T, heads] float32) over the keys this cache holds."""
        return self._attend(layer, q, batch, None)

    def _attend(self, layer: int, q: MLAQueries, batch: StepBatch, kernel: Kernel | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        m, cache, scale = self.mla, self.kv.k[layer], self.kv.scale
        t, heads = q.nope.shape[:2]
        out = q.nope.new_empty(t, heads, m.v_head_dim)
        lse = torch.empty(t, heads, dtype=torch.float32, device=q.nope.device)
        if batch.decode_rows.numel():
            rows = batch.decode_rows
            absorbed = torch.cat([head_linear(q.nope[rows], self.w.w_uk), q.pe[rows]], dim=-1)
            o, s = _decode(absorbed, cache, batch, scale, kernel)  # [B, heads, C + R]
            out[rows], lse[rows] = head_linear(o[..., : m.kv_lora_rank], self.w.w_uv), s
        for p in batch.prefills:
            rows = slice(p.start, p.start + p.length)
            k, v = self._expand(cache[p.kv_slots])  # [L, heads, N + R], [L, heads, V]
            qp = torch.cat([q.nope[rows], q.pe[rows]], dim=-1)  # [n, heads, N + R]
            o, s = _full(qp.transpose(0, 1)[None], k.transpose(0, 1)[None],
                         v.transpose(0, 1)[None], p.mask[None, None], scale, kernel)
            out[rows], lse[rows] = o[0].transpose(0, 1), s[0].transpose(0, 1)
        return out, lse

    def _expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys [L, heads, N + R] and values [L, heads, V] of cache rows [L, 1, C + R]."""
        m, heads = self.mla, self.cfg.num_heads
        kv = linear(rows[:, 0, : m.kv_lora_rank], self.w.kv_b).view(
            -1, heads, m.qk_nope_head_dim + m.v_head_dim)  # [L, heads, N + V]
        k_pe = rows[:, :, m.kv_lora_rank:].expand(-1, heads, -1)  # [L, heads, R]
        return torch.cat([kv[..., : m.qk_nope_head_dim], k_pe], dim=-1), \
            kv[..., m.qk_nope_head_dim:]


def _decode(q: torch.Tensor, cache: torch.Tensor, batch: StepBatch, scale: float,
            kernel: Kernel | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode queries q [B, heads, C + R] over the latent rows cache [S, 1, C + R] as
    both keys and values -> (out [B, heads, C + R], lse [B, heads])."""
    slots, mask = batch.decode_kv_slots, batch.decode_mask
    if (cpu := cpu_decode_attention(q, cache, cache, slots, mask, scale)) is not None:
        return cpu
    rows = cache[slots].transpose(1, 2)  # [B, 1, L, C + R]
    o, s = _full(q.unsqueeze(2), rows, rows, mask[:, None, None, :], scale, kernel)
    return o.squeeze(2), s.squeeze(2)


def _full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
          scale: float, kernel: Kernel | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernel`, by default `partial_attention`, where v's head dim may differ from q's and
    k's. The CPU's fused kernel takes one head dim, so the narrower side is padded with
    zeros, which add nothing to a score or a value, and the output is cut back to v's."""
    d, dv = q.shape[-1], v.shape[-1]
    if kernel is not None:  # SDPA: any v head dim
        return kernel(q, k, v, mask, scale)
    if dv == d:
        return partial_attention(q, k, v, mask, scale)
    if q.device.type != "cpu":
        return reference_partial_attention(q, k, v, mask, scale)
    width = max(d, dv)
    q, k, v = F.pad(q, (0, width - d)), F.pad(k, (0, width - d)), F.pad(v, (0, width - dv))
    out, lse = partial_attention(q, k, v, mask, scale)
    return out[..., :dv], lse


def compiled_mla_block(kernels: ModuleType, cfg: ModelConfig, w: MLAWeights,
                       around: tuple[torch.Tensor, Weight, torch.Tensor], h: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                       batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's MLA block as one compiled call (`mla_block_f32`), with every weight
    in panels. Returns h [T, H] plus the attention's output, and that sum
    post-attention-normed. `around` holds the layer's input norm [H], o_proj and
    post-attention norm [H]."""
    m = cfg.mla
    assert m is not None
    input_norm, o, post_norm = around
    return kernels.mla_block_f32(
        h, input_norm, *panel_args(w.qkv_a), w.q_a_norm, *panel_args(w.q_b), w.kv_a_norm,
        *panel_args(w.w_uk)[:2], *panel_args(w.w_uv)[:2], cos, sin, m.rope_interleave, cache,
        batch.slot_mapping, batch.decode_kv_slots, batch.decode_mask, *panel_args(o),
        post_norm, cfg.num_heads, m.q_lora_rank or 0, m.qk_nope_head_dim, cfg.rms_norm_eps,
        cfg.attention_scale)


def panel_args(w: Weight | None) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """A linear in panels as the compiled blocks take it: (panels, column scales, real
    columns). The scales are the int8 weights', or None for float32."""
    if w is None:
        return None, None, 0
    assert isinstance(w, Panels)
    return w.panels, w.scales if isinstance(w, Int8Panels) else None, w.shape[-2]


def head_linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [T, heads, K] through one matrix per head, w [heads, N, K] -> [T, heads, N]. It
    runs the compiled kernel where w is in panels and x is float32 on the CPU, else
    torch's bmm."""
    if isinstance(w, Panels) and x.dtype == torch.float32 and x.stride(-1) == 1 \
            and (kernels := cpu_kernels()) is not None:
        if isinstance(w, Int8Panels):
            return kernels.head_linear_i8(x, w.panels, w.scales)
        return kernels.head_linear_f32(x, w.panels)
    if isinstance(w, Int8Panels):
        xd = dequantized_activations(x.float())
        return torch.bmm(xd.transpose(0, 1), w.dequantize().transpose(1, 2)).transpose(0, 1) \
            .to(x.dtype)
    w = w.unpack() if isinstance(w, PanelWeights) else w
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
          ) -> torch.Tensor:
    """`apply_rope` of x [T, n, R]. On the CPU in float32 it runs the compiled kernel's,
    the one the compiled block runs, so the bits are the same."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(-1) == 1 \
            and cos.dtype == torch.float32 and (kernels := cpu_kernels()) is not None:
        return kernels.rope_f32(x, cos.contiguous(), sin.contiguous(), interleaved)
    return apply_rope(x, cos, sin, interleaved)
