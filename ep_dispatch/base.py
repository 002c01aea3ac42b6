"""The interfaces of the dispatch layer.

They follow DeepEP's shape: the layout comes first, then the data, and combine reuses the
layout's handle.

The seam, as the attention service calls it:

    route(x [T,H]) -> topk_ids [T,K], topk_weights [T,K]          # attention service
    experts(layer, x, topk_ids, topk_weights) -> out [T,H]        # an ExpertsClient

Inside every `ExpertsClient` the steps are DeepEP's; see `ep_dispatch.layout`.

1. The layout places each row.
2. The rows travel. Each expert rank runs `ExpertBank.forward`, a grouped SwiGLU over its
   local experts, and returns raw outputs, row-aligned, without router weights.
3. `combine`, `out[t] = sum_rows weight * y`, is applied on the attention side. As in
   DeepEP's combine, it sums in float32 and rounds once to the activations' dtype.

Every step starts with `begin_step(num_tokens)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ep_dispatch.placement import Placement

# (layer, x [N, H] grouped by local expert, tokens per local expert) -> y [N, H], unweighted.
ExpertFn = Callable[[int, torch.Tensor, list[int]], torch.Tensor]
# (layer, rows [N, width] grouped by expert, counts [E_local] int64 on the rows' device,
# an upper bound of any count) -> [N, H]: the experts without a host sync (CUDA graphs)
DeviceExpertFn = Callable[[int, torch.Tensor, torch.Tensor, int], torch.Tensor]
# The whole local layer in one call, as `ExpertBank.forward_layer`:
# (layer, x [T, H], topk_ids [T, K], topk_weights [T, K]) -> (out [T, H] combined, when the
# combine began in perf_counter ns), or None where it does not apply.
LayerFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor],
                   tuple[torch.Tensor, int] | None]


class ExpertsClient(Protocol):
    """The attention side of a MoE layer when experts may live in other processes.

    One call does dispatch, the remote grouped GEMM, and combine with the router weights.

    Collective backends move all ranks in `lockstep`. Every step starts with `begin_step`
    on every attention rank, and a rank without work runs `idle_step`.
    """

    lockstep: bool

    def begin_step(self, num_tokens: int, micro_batches: int = 1) -> bool:
        """Whether any rank has work this step.

        It takes this rank's token count and the number of micro-batches it runs them as.
        For lockstep backends this is a collective, in which the ranks agree on the step's
        rounds. `deepep` also picks its kernels from the largest count.
        """
        ...

    def idle_step(self) -> None:
        """Join this step's exchanges with zero rows. Only lockstep backends use this."""
        ...

    def __call__(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """MoE output [T, H] for x [T, H] routed to topk_ids [T, K] with topk_weights [T, K]."""
        ...

    def describe(self) -> list[str]:
        """One line per expert rank reached, for health reports."""
        ...

    def ready(self) -> bool:
        """Whether every expert rank can still be reached, for /health."""
        ...

    def close(self) -> None:
        """Release connections and threads."""
        ...


class Exchange(Protocol):
    """A MoE layer call in flight, from `PointToPoint.start`.

    Once finished, `held_s` is the longest time an expert rank held the call, for queueing
    and compute. It is 0.0 where not reported. It tells the wire's share of the call's
    time.
    """

    held_s: float

    def finish(self) -> torch.Tensor:
        """The MoE output [T, H], once the experts answered."""
        ...


@runtime_checkable
class Pipelined(Protocol):
    """An `ExpertsClient` whose layer calls can start and finish apart.

    A step split into micro-batches can then compute one while another's call is out.
    The backends that do this are `rpc`, `torch`, and a DCP group's seam over them.
    """

    @property
    def overlaps(self) -> bool:
        """Whether `start` returns before the experts answer. Otherwise it runs the call."""
        ...

    def start(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> Exchange:
        """Start the call for x [T, H] routed to topk_ids [T, K] with topk_weights [T, K].

        Its `finish()` gives the MoE output [T, H].
        """
        ...

    def round_trip_s(self) -> float | None:
        """The exchange's recent round trip on the wire, without the experts' time.

        None means not measured. `--micro-batches auto` weighs it against a step.
        """
        ...


@runtime_checkable
class Movable(Protocol):
    """An `ExpertsClient` whose experts can move while serving, for live EPLB with `rpc`.

    The expert ranks load a new placement beside the current one, then the calls switch.
    """

    @property
    def placement_version(self) -> int: ...

    @property
    def placement_json(self) -> str: ...

    def prepare(self, version: int, placement_json: str) -> float:
        """Have every expert rank load its share of `placement_json` as `version`.

        This blocks, and runs off the step thread. Returns the slowest rank's seconds.
        """
        ...

    def switch(self, version: int) -> Placement:
        """Lay the calls out by the prepared `version` from now on, between steps."""
        ...


class Done:
    """An exchange that finished as it started, for a backend with nothing to overlap."""

    held_s = 0.0

    def __init__(self, y: torch.Tensor) -> None:
        self.y = y

    def finish(self) -> torch.Tensor:
        return self.y


class PointToPoint:
    """Defaults for backends where each attention rank steps on its own."""

    lockstep = False
    overlaps = False  # whether `start` returns before the experts answer

    def __call__(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        raise NotImplementedError

    def start(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> Exchange:
        """Start a layer call whose output `finish()` gives.

        Where the backend can, the rows go out now and `finish` reads the answers, so the
        caller can compute another micro-batch meanwhile. Here, the whole call runs at once.
        """
        return Done(self(layer, x, topk_ids, topk_weights))

    def begin_step(self, num_tokens: int, micro_batches: int = 1) -> bool:
        return num_tokens > 0

    def round_trip_s(self) -> float | None:
        return None

    def idle_step(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def close(self) -> None:
        pass
