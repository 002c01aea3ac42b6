"""The attention side of the MoE seam: routed tokens in, weighted expert outputs out."""

from __future__ import annotations

from typing import Protocol

import torch

from ep_dispatch.base import Dispatcher
from services.expert.experts import ExpertBank


class ExpertsClient(Protocol):
    def __call__(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """MoE output [T, H] for x [T, H] routed to topk_ids [T, K] with topk_weights [T, K]."""
        ...


class InProcessExperts:
    """Experts held in this process, reached through a dispatcher (the `local` backend)."""

    def __init__(self, dispatcher: Dispatcher, bank: ExpertBank) -> None:
        self.dispatcher = dispatcher
        self.bank = bank

    def __call__(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        recv_x, tokens_per_expert, handle = self.dispatcher.dispatch(x, topk_ids, topk_weights)
        y = self.bank.forward(layer, recv_x, tokens_per_expert)  # [N, H]
        return self.dispatcher.combine(y, handle)
