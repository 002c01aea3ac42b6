"""`local` backend: attention and experts in one process; dispatch is a sort by expert."""

from __future__ import annotations

import torch

from ep_dispatch.base import DeviceExpertFn, DispatchHandle, ExpertFn, PointToPoint
from ep_dispatch.layout import weighted_sum
from ep_dispatch.metrics import phase
from ep_dispatch.wire import activation_rows


class LocalDispatcher:
    """All `num_experts` experts are local; no bytes leave the process."""

    def __init__(self, num_experts: int) -> None:
        self.num_local_experts = num_experts

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, list[int], DispatchHandle]:
        rows, counts, handle = self.sort(x, topk_ids, topk_weights)
        return rows, counts.tolist(), handle

    def sort(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """`dispatch` with the per-expert counts left on the device ([E] int64): no host
        synchronisation."""
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat_ids, stable=True)  # [N], N = T*K, rows grouped by expert
        src_token = order // top_k
        # [E]; not bincount, which synchronises twice with a CUDA device to size its output
        counts = flat_ids.new_zeros(self.num_local_experts).index_add_(
            0, flat_ids, torch.ones_like(flat_ids))
        weights = topk_weights.reshape(-1)[order]  # [N]
        handle = DispatchHandle(src_token=src_token, weights=weights, num_tokens=x.shape[0])
        return x[src_token], counts, handle

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return weighted_sum(y, handle.src_token, handle.weights, handle.num_tokens)


class LocalExperts(PointToPoint):
    """`ExpertsClient` for experts held in this process, through a `LocalDispatcher`."""

    def __init__(self, num_experts: int, expert_fn: ExpertFn,
                 quantization: str | None = None,
                 device_fn: DeviceExpertFn | None = None) -> None:
        self.dispatcher = LocalDispatcher(num_experts)
        self.expert_fn, self.device_fn = expert_fn, device_fn
        self.quantization = quantization

    def __call__(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        with phase("dispatch", "local", layer, x.shape[0]):
            rows = activation_rows(x, self.quantization)  # [T, H], or MXFP4 rows
            recv, tokens_per_expert, handle = self.dispatcher.dispatch(rows, topk_ids,
                                                                       topk_weights)
            y = self.expert_fn(layer, recv, tokens_per_expert)  # [N, H]
        with phase("combine", "local", layer, x.shape[0]):
            return self.dispatcher.combine(y, handle).to(x.dtype)

    def on_device(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """`__call__` without a host synchronisation, for a CUDA graph to capture: the
        counts stay on the device and `device_fn` runs the experts on them (a token's top-k
        experts differ, so no expert gets more rows than there are tokens). No dispatch
        metrics: a replayed graph runs no Python."""
        if self.device_fn is None:
            raise ValueError("these experts cannot run on device-side counts")
        rows = activation_rows(x, self.quantization)  # [T, H], or MXFP4 rows
        recv, counts, handle = self.dispatcher.sort(rows, topk_ids, topk_weights)
        y = self.device_fn(layer, recv, counts, x.shape[0])  # [N, H]
        return self.dispatcher.combine(y, handle).to(x.dtype)

    def describe(self) -> list[str]:
        return [f"in-process: all {self.dispatcher.num_local_experts} experts of every layer"]
