"""`local` backend: attention and experts in one process; dispatch is a sort by expert.

`LocalExperts` lays the rows out with the `Layout` of one rank holding every expert. With
`local` on the CPU, a MoE layer is one compiled call (`csrc/moe_layer_cpu.cpp`,
`ExpertBank.forward_layer`). It does the layout, the MXFP4 activations where W4A4, the
grouped experts and the combine. It gives the bits of the parts it replaces, and the same
per-expert, dispatch and combine metrics. `local` is the only backend whose steps CUDA
graphs capture (`LocalExperts.on_device`).
"""

from __future__ import annotations

import time

import torch

from common.tracing import layer_span
from ep_dispatch.base import DeviceExpertFn, ExpertFn, LayerFn, PointToPoint
from ep_dispatch.layout import Layout, combine, sort_rows
from ep_dispatch.metrics import observe, phase
from ep_dispatch.wire import activation_rows


class LocalExperts(PointToPoint):
    """`ExpertsClient` for all `num_experts` experts, held in this process.

    It uses the layout of one rank holding every expert, where a row's slot is its expert
    id, and no bytes move. Where `layer_fn` runs a layer whole, as one compiled call on the
    CPU, it does so. Otherwise the layout, `expert_fn` and the combine run one after
    another.
    """

    def __init__(self, num_experts: int, expert_fn: ExpertFn,
                 quantization: str | None = None,
                 device_fn: DeviceExpertFn | None = None,
                 layer_fn: LayerFn | None = None) -> None:
        self.num_experts = num_experts
        self.expert_fn, self.device_fn, self.layer_fn = expert_fn, device_fn, layer_fn
        self.quantization = quantization

    def layout(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Layout:
        """The rows of topk_ids [T, K] grouped by expert, without a host synchronisation."""
        return sort_rows(topk_ids.reshape(-1), topk_weights, [self.num_experts],
                         self.num_experts)

    def __call__(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.layer_fn is not None:
            start = time.perf_counter_ns()
            with layer_span("dispatch", {"switchyard.layer": layer,
                                         "switchyard.tokens": x.shape[0]}):
                whole = self.layer_fn(layer, x, topk_ids, topk_weights)
            if whole is not None:  # the dispatch up to the combine, then the combine
                out, combined = whole
                observe("dispatch", "local", x.shape[0], (combined - start) / 1e9)
                observe("combine", "local", x.shape[0],
                        (time.perf_counter_ns() - combined) / 1e9)
                return out.to(x.dtype)
        with phase("dispatch", "local", layer, x.shape[0]):
            rows = activation_rows(x, self.quantization)  # [T, H], or MXFP4 rows
            layout = self.layout(topk_ids, topk_weights)
            y = self.expert_fn(layer, rows[layout.src_token], layout.expert_counts[0])  # [N, H]
        with phase("combine", "local", layer, x.shape[0]):
            return combine(y, layout).to(x.dtype)

    def on_device(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """`__call__` without a host synchronisation, for a CUDA graph to capture.

        The counts stay on the device, and `device_fn` runs the experts on them. A token's
        top-k experts differ, so no expert gets more rows than there are tokens. There are
        no dispatch metrics, because a replayed graph runs no Python.
        """
        if self.device_fn is None:
            raise ValueError("these experts cannot run on device-side counts")
        rows = activation_rows(x, self.quantization)  # [T, H], or MXFP4 rows
        layout = self.layout(topk_ids, topk_weights)
        y = self.device_fn(layer, rows[layout.src_token], layout.counts[0], x.shape[0])  # [N, H]
        return combine(y, layout).to(x.dtype)

    def describe(self) -> list[str]:
        return [f"in-process: all {self.num_experts} experts of every layer"]
