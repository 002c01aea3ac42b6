"""The paged KV cache tensors and the paged attention that reads them.

`KVCache.attend` is torch's fused CPU flash attention with grouped KV heads folded into the
query rows. Where the compiled CPU kernels run, it is their decode kernel instead, in
`csrc/attention_cpu.cpp`, which DCP shards call too. That kernel reads the keys in place
through the slot table rather than gathering them into a padded copy, and folds 16 keys'
scores at once. With DCP each rank attends over its share of the keys (`attend_partial`),
and the shares are merged by log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dcp.batch import StepBatch
from dcp.merge import partial_attention
from moe_kernels.selection import cpu_decode_attention
from services.model.config import ModelConfig


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                       layers: int | None = None) -> int:
    """A block's bytes over `layers` layers: the decoder's, unless MTP drafts too."""
    per_token = (layers or config.num_layers) * config.kv_elements_per_token
    return per_token * block_size * torch.empty(0, dtype=dtype).element_size()


class KVCache:
    """Per layer, K and V of shape [num_blocks * block_size, kv_heads, head_dim], slot-major.

    With MLA, one tensor per layer [slots, 1, kv_lora_rank + qk_rope_head_dim] of latent
    rows is both K and V (`services.attention.mla`): `v[layer] is k[layer]`.
    """

    def __init__(
        self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
        device: str = "cpu", layers: int | None = None,
    ) -> None:
        """`layers` counts the decoder's layers by default; when drafting, it counts those
        and the MTP layers."""
        shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
        layers = layers or config.num_layers
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = self.k if config.mla else [torch.zeros(shape, dtype=dtype, device=device)
                                            for _ in range(layers)]
        self.scale = config.attention_scale

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor | None, slots: torch.Tensor,
              foreign: bool = False) -> None:
        """Store k, v [T, kv_heads, head_dim] at `slots` [T]. With MLA, v is None and k
        holds the rows. With `foreign`, slots of -1 are skipped: another DCP rank stores
        those tokens."""
        if foreign:
            keep = slots >= 0
            k, slots = k[keep], slots[keep]
            v = None if v is None else v[keep]
        self.k[layer][slots] = k
        if v is not None:
            self.v[layer][slots] = v

    def attend(self, layer: int, q: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Attention of q [T, heads, head_dim] over each sequence's cached keys -> same shape.

        On the CPU this is the same fused kernel as a DCP shard's,
        `dcp.merge.partial_attention`. With every key here, its output is already the full
        attention. Elsewhere it is torch's SDPA with grouped KV heads, which needs no
        log-sum-exp and no K/V copies per head.
        """
        if q.device.type == "cpu":
            return self.attend_partial(layer, q, batch)[0]
        return self._attend(layer, q, batch, sdpa)[0]

    def attend_partial(self, layer: int, q: torch.Tensor, batch: StepBatch
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q [T, heads, head_dim] over the keys this cache holds, one DCP
        shard's. Returns (out [T, heads, head_dim], lse [T, heads] float32) for `dcp.merge`."""
        return self._attend(layer, q, batch, partial_attention)

    def _attend(self, layer: int, q: torch.Tensor, batch: StepBatch, kernel: Kernel
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend the decodes as one batch, then each prefill chunk. On the CPU in float32
        the decodes run on the compiled kernel, which reads the keys in place; otherwise
        `kernel` runs over a padded copy."""
        k_all, v_all = self.k[layer], self.v[layer]
        scale = self.scale
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if batch.decode_rows.numel() and (cpu := cpu_decode_attention(
                q[batch.decode_rows], k_all, v_all, batch.decode_kv_slots, batch.decode_mask,
                scale)) is not None:
            out[batch.decode_rows], lse[batch.decode_rows] = cpu
        elif batch.decode_rows.numel():
            qd = q[batch.decode_rows].unsqueeze(2)  # [B, heads, 1, D]
            k = k_all[batch.decode_kv_slots].transpose(1, 2)  # [B, kv_heads, L, D]
            v = v_all[batch.decode_kv_slots].transpose(1, 2)
            o, s = kernel(qd, k, v, batch.decode_mask[:, None, None, :], scale)
            out[batch.decode_rows], lse[batch.decode_rows] = o.squeeze(2), s.squeeze(2)
        for p in batch.prefills:
            rows = slice(p.start, p.start + p.length)
            qp = q[rows].transpose(0, 1)[None]  # [1, heads, n, D]
            k = k_all[p.kv_slots].transpose(0, 1)[None]  # [1, kv_heads, L, D]
            v = v_all[p.kv_slots].transpose(0, 1)[None]
            o, s = kernel(qp, k, v, p.mask[None, None], scale)
            out[rows], lse[rows] = o[0].transpose(0, 1), s[0].transpose(0, 1)
        return out, lse


# (q [B, H, Tq, D], k, v [B, KVH, L, D], mask [B, 1, Tq, L], scale) -> (out, lse [B, H, Tq])
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                  tuple[torch.Tensor, torch.Tensor]]


# Not cuDNN's SDPA: it builds an execution plan for each new shape, and decode shapes change
# every step. On an H200, 10 decode steps spent 0.82 s in SDPA (docs/benchmarks.md). Flash
# takes no mask, so the mem-efficient kernel runs, or math where it cannot.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Full attention by torch's SDPA. The lse is not computed and is NaN, as `attend`
    drops it. Every query sees at least its own key here, so no row is fully masked.

    With grouped KV heads, each KV head's g query heads are folded into its query rows,
    [B, KVH, g * Tq, D]. That needs no K/V copies, and the mem-efficient kernel qualifies.
    torch's `enable_gqa` runs only on flash, which takes no mask, and on math, which holds
    all scores.
    """
    b, heads, tq, d = q.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    if g > 1:  # head h uses KV head h // g, as in transformers' repeat_kv
        q = q.reshape(b, kv_heads, g * tq, d)  # rows (j, t): query head j of the group
        mask = mask.repeat(1, 1, g, 1) if tq > 1 else mask  # [B, 1, g * Tq, L]
    with sdpa_kernel(_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, tq, d), torch.full((b, heads, tq), float("nan"),
                                                    device=q.device)
