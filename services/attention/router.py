"""Router gate: top-k experts per token and their weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_kernels.cpu_kernels import cpu_kernels
from moe_kernels.panels import PanelWeights
from moe_kernels.selection import linear


def route(
    x: torch.Tensor, gate: torch.Tensor | PanelWeights, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick experts for x [T, H] with gate [E, H].

    Returns topk_ids [T, K] int64 and topk_weights [T, K] in x's dtype: softmax over all
    experts (in float32), top-k, renormalised to sum to 1 when `normalize`. On the CPU in
    float32 with the gate in panels, one compiled call (`route_f32`; its softmax may
    differ from torch's in the last bit).
    """
    if isinstance(gate, PanelWeights) and x.dtype == torch.float32 and x.dim() == 2 \
            and x.device.type == "cpu" and (kernels := cpu_kernels()) is not None:
        return kernels.route_f32(x, gate.panels, gate.shape[0], top_k, normalize)
    probs = F.softmax(linear(x, gate), dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)
