"""Router gate: top-k experts per token and their weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_kernels.cpu_kernels import cpu_kernels
from moe_kernels.panels import PanelWeights
from moe_kernels.selection import linear
from services.model.families import Routing


def route(
    x: torch.Tensor, gate: torch.Tensor | PanelWeights, routing: Routing,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick experts for x [T, H] with gate [E, H], as transformers' router of the model
    does (`Routing`). bias [E] float32 is DeepSeek-V3's `e_score_correction_bias`.

    Returns topk_ids [T, K] int64 and topk_weights [T, K] in x's dtype. The plain case is a
    softmax over all experts in float32, then top-k, renormalised where asked. On the CPU
    in float32 with the gate in panels, it runs as one compiled call (`route_f32`), whose
    softmax may differ from torch's in the last bit. DeepSeek's group-limited routers run
    there as one call too, by the same torch operations called from C++
    (`route_grouped_f32`), with the same bits.
    """
    plain = routing.method == "greedy" and routing.scoring == "softmax" \
        and routing.scaling == 1.0
    if plain and isinstance(gate, PanelWeights) and x.dtype == torch.float32 \
            and x.dim() == 2 and x.device.type == "cpu" and (kernels := cpu_kernels()) is not None:
        return kernels.route_f32(x, gate.panels, gate.shape[0], routing.top_k,
                                 routing.normalize)
    if routing.method != "greedy" and isinstance(gate, PanelWeights) \
            and x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu" \
            and (kernels := cpu_kernels()) is not None:  # DeepSeek's: the same operations
        return kernels.route_grouped_f32(x, gate.panels, gate.shape[0], bias,
                                         routing.method == "noaux_tc", routing.n_group,
                                         routing.topk_group, routing.top_k, routing.normalize,
                                         routing.scaling)
    dtype = gate.dtype if isinstance(gate, torch.Tensor) else torch.float32
    logits = linear(x.to(dtype), gate).float()  # [T, E] (DeepSeek's gate is float32)
    if routing.scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = F.softmax(logits, dim=-1, dtype=torch.float32)
    if routing.method == "noaux_tc":
        weights, ids = _noaux_tc(scores, routing, bias)
    elif routing.method == "group_limited_greedy":
        weights, ids = _group_limited_greedy(scores, routing)
    else:
        weights, ids = torch.topk(scores, routing.top_k, dim=-1)
    if routing.normalize:  # transformers' V3 router adds 1e-20; Qwen's and Mixtral's do not
        eps = 1e-20 if routing.scoring == "sigmoid" else 0.0
        weights = weights / (weights.sum(dim=-1, keepdim=True) + eps)
    if routing.scaling != 1.0:
        weights = weights * routing.scaling
    return ids, weights.to(x.dtype)


def _group_mask(group_scores: torch.Tensor, routing: Routing, experts: int) -> torch.Tensor:
    """[T, E] bool: the experts of each token's top `topk_group` groups, from group_scores
    [T, n_group]. Ties between groups go the way torch's unsorted topk takes them, as in
    transformers."""
    chosen = torch.topk(group_scores, k=routing.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1).bool()  # [T, n_group]
    return mask.repeat_interleave(experts // routing.n_group, dim=1)


def _group_limited_greedy(scores: torch.Tensor, routing: Routing
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: a group scores its best expert, and the other groups' scores become
    0.0, not -inf, as in transformers' and DeepSeek's V2 router."""
    t, e = scores.shape
    group_scores = scores.view(t, routing.n_group, -1).max(dim=-1).values
    masked = scores.masked_fill(~_group_mask(group_scores, routing, e), 0.0)
    return torch.topk(masked, k=routing.top_k, dim=-1, sorted=False)


def _noaux_tc(scores: torch.Tensor, routing: Routing, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3: the biased scores choose. A group scores the sum of its top two, and
    the other groups' experts are masked to -inf. The weights are the unbiased scores."""
    t, e = scores.shape
    choice = scores if bias is None else scores + bias  # [T, E]
    group_scores = choice.view(t, routing.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    choice = choice.masked_fill(~_group_mask(group_scores, routing, e), float("-inf"))
    ids = torch.topk(choice, k=routing.top_k, dim=-1, sorted=False)[1]
    return scores.gather(1, ids), ids
