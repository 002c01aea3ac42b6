"""The interfaces of the dispatch layer (DeepEP's shape: layout first, then data, a handle
reused by combine)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

# (layer, x [N, H] grouped by local expert, tokens per local expert) -> y [N, H], unweighted.
ExpertFn = Callable[[int, torch.Tensor, list[int]], torch.Tensor]
# (layer, rows [N, width] grouped by expert, counts [E_local] int64 on the rows' device,
# an upper bound of any count) -> [N, H]: the experts without a host sync (CUDA graphs)
DeviceExpertFn = Callable[[int, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class DispatchHandle:
    """What `combine` needs to undo a `dispatch`; opaque to callers.

    Attributes:
        src_token: [N] int64, the source token row (in `x` of dispatch) of each received row.
        weights: [N] router weight of each received row, in the dtype of `x`.
        num_tokens: T, the number of rows of `x` given to dispatch.
    """

    src_token: torch.Tensor
    weights: torch.Tensor
    num_tokens: int


class Dispatcher(Protocol):
    """Moves each token to the experts it was routed to, and the expert outputs back,
    for a rank that is both sender and receiver (symmetric expert parallelism).

    The router weights are applied by `combine`, never by the experts: expert ranks
    return raw FFN outputs, row-aligned with what they received.
    """

    num_local_experts: int

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, list[int], DispatchHandle]:
        """Send tokens to their experts.

        Args:
            x: [T, H] hidden states of this rank's tokens.
            topk_ids: [T, K] int64 global expert ids chosen by the router.
            topk_weights: [T, K] router weights (any float dtype).

        Returns:
            recv_x: [N, H] received rows, grouped by local expert in expert order.
            tokens_per_expert: E_local ints, the length of each local expert's run in recv_x.
            handle: reused by `combine`.
        """
        ...

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Bring expert outputs y [N, H] (row-aligned with recv_x) back as out [T, H].

        out[t] = sum over t's routed rows r of weight[r] * y[r].
        """
        ...


class ExpertsClient(Protocol):
    """The attention side of a MoE layer when experts may live in other processes:
    dispatch, remote grouped GEMM, combine (with the router weights), as one call.

    Collective backends move all ranks in `lockstep`: every step starts with
    `begin_step` on every attention rank, and a rank without work runs `idle_step`.
    """

    lockstep: bool

    def begin_step(self, num_tokens: int) -> bool:
        """Whether any rank has work this step, given this rank's token count (collective
        for lockstep backends; `deepep` also picks its kernels from the largest count)."""
        ...

    def idle_step(self) -> None:
        """Join this step's exchanges with zero rows (lockstep backends only)."""
        ...

    def __call__(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """MoE output [T, H] for x [T, H] routed to topk_ids [T, K] with topk_weights [T, K]."""
        ...

    def describe(self) -> list[str]:
        """One line per expert rank reached (for health reports)."""
        ...

    def ready(self) -> bool:
        """Whether every expert rank can still be reached (for /health)."""
        ...

    def close(self) -> None:
        """Release connections and threads."""
        ...


class PointToPoint:
    """Defaults for backends where each attention rank steps on its own."""

    lockstep = False

    def begin_step(self, num_tokens: int) -> bool:
        return num_tokens > 0

    def idle_step(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def close(self) -> None:
        pass
