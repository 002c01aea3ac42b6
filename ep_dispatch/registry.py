"""Dispatch backends by name; their packages (torch among them) are imported only when
one is built, so `switchyard serve` checks a backend's name without them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.device import collective_backend

if TYPE_CHECKING:
    import torch

    from ep_dispatch.base import DeviceExpertFn, ExpertFn, ExpertsClient
    from ep_dispatch.deepep_config import DeepEPSettings
    from ep_dispatch.placement import Placement
    from ep_dispatch.torch_dist import World
    from ep_dispatch.wire import RowFormat


def _float32() -> torch.dtype:
    import torch

    return torch.float32


@dataclass(frozen=True)
class BackendContext:
    """What a backend may need; each uses its share.

    expert_fn: the in-process experts (`local`). expert_addresses: one (host, port) per
    expert rank (`rpc`). placement_file: JSON placement, else balanced.
    """

    moe_layers: list[int]
    num_experts: int
    expert_fn: ExpertFn | None = None
    device_expert_fn: DeviceExpertFn | None = None  # `local`: the experts for CUDA graphs
    expert_addresses: list[tuple[str, int]] = field(default_factory=list)
    placement_file: Path | None = None
    replicas: int = 1  # without a placement file: each expert on this many ranks
    call_timeout: float = 30.0
    connect_timeout: float = 30.0  # `rpc`: to reach an expert service
    rendezvous_timeout: float = 300.0  # lockstep backends: for every rank to join
    world: World | None = None  # `torch`: this rank's place among all ranks
    hidden_size: int = 0
    dtype: torch.dtype = field(default_factory=_float32)
    quantization: str | None = None  # "w4a4": activations travel as MXFP4
    device: str = "cpu"  # where the activations live
    top_k: int = 0  # experts per token (`deepep` pads empty ranks with it)
    deepep: DeepEPSettings | None = None  # `deepep`: the --deepep-* flags


def _local(ctx: BackendContext) -> ExpertsClient:
    from ep_dispatch.local import LocalExperts

    if ctx.expert_fn is None:
        raise ValueError("the local backend needs the experts in this process")
    return LocalExperts(ctx.num_experts, ctx.expert_fn, ctx.quantization,
                        ctx.device_expert_fn)


def _rpc(ctx: BackendContext) -> ExpertsClient:
    from ep_dispatch.placement import make_placement
    from ep_dispatch.rpc import RpcExperts

    if not ctx.expert_addresses:
        raise ValueError("the rpc backend needs --expert-addresses HOST:PORT,...")
    placement = make_placement(ctx.moe_layers, ctx.num_experts, len(ctx.expert_addresses),
                               ctx.placement_file, ctx.replicas)
    return RpcExperts(placement, ctx.expert_addresses, ctx.call_timeout, ctx.connect_timeout,
                      ctx.quantization)


def _collective_world(name: str, ctx: BackendContext) -> tuple[World, Placement]:
    """What the lockstep backends (`torch`, `nccl`, `deepep`) share: a world, a placement
    over its expert ranks."""
    from ep_dispatch.placement import make_placement

    if ctx.world is None:
        raise ValueError(f"the {name} backend needs --dist-init HOST:PORT and the rank layout")
    return ctx.world, make_placement(ctx.moe_layers, ctx.num_experts,
                                     ctx.world.num_experts, ctx.placement_file, ctx.replicas)


def _rows(ctx: BackendContext) -> RowFormat:
    from ep_dispatch.wire import RowFormat

    return RowFormat(ctx.hidden_size, ctx.dtype, ctx.quantization)


def _torch(ctx: BackendContext) -> ExpertsClient:
    from ep_dispatch.torch_dist import TorchExperts, join

    world, placement = _collective_world("torch", ctx)
    rows = _rows(ctx)
    join(world, ctx.rendezvous_timeout, collective_backend(ctx.device), rows)
    return TorchExperts(world, placement, rows, ctx.device)


def _nccl(ctx: BackendContext) -> ExpertsClient:
    from ep_dispatch.nccl import CupyNccl, import_nccl
    from ep_dispatch.torch_dist import TorchExperts

    import_nccl()
    world, placement = _collective_world("nccl", ctx)
    rows = _rows(ctx)
    return TorchExperts(world, placement, rows, ctx.device,
                        CupyNccl(world, ctx.rendezvous_timeout, rows), backend="nccl")


def _deepep(ctx: BackendContext) -> ExpertsClient:
    from ep_dispatch.deepep import DeepEPExperts
    from ep_dispatch.deepep_config import DeepEPSettings, check_deepep, import_deep_ep
    from ep_dispatch.torch_dist import join

    world, placement = _collective_world("deepep", ctx)
    settings = ctx.deepep or DeepEPSettings()
    check_deepep(settings, world.size, ctx.hidden_size, ctx.top_k, placement.most_local,
                 ctx.dtype)
    import_deep_ep()
    join(world, ctx.rendezvous_timeout, "nccl", _rows(ctx))
    return DeepEPExperts(world, placement, ctx.hidden_size, ctx.top_k, settings)


@dataclass(frozen=True)
class ExpertSide:
    """What the expert side of a lockstep backend serves with, on one expert rank.

    expert_fn: the rank's experts (`ExpertBank.forward`); rows: what travels; ready: called
    once the rank joined the world (it reports readiness and logs)."""

    world: World
    placement: Placement
    expert_fn: ExpertFn
    rows: RowFormat
    device: str
    rendezvous_timeout: float
    top_k: int
    deepep: DeepEPSettings | None
    ready: Callable[[], None]


def _serve_torch(side: ExpertSide) -> None:
    from ep_dispatch.torch_dist import serve_experts

    _join(side, collective_backend(side.device))
    serve_experts(side.world, side.placement, side.expert_fn, side.rows, side.device)


def _serve_nccl(side: ExpertSide) -> None:
    from ep_dispatch.nccl import CupyNccl
    from ep_dispatch.torch_dist import serve_experts

    collective = CupyNccl(side.world, side.rendezvous_timeout, side.rows)
    side.ready()
    serve_experts(side.world, side.placement, side.expert_fn, side.rows, side.device,
                  collective)


def _serve_deepep(side: ExpertSide) -> None:
    from ep_dispatch.deepep import serve_deepep
    from ep_dispatch.deepep_config import DeepEPSettings, check_deepep, import_deep_ep

    settings = side.deepep or DeepEPSettings()
    check_deepep(settings, side.world.size, side.rows.hidden, side.top_k,
                 side.placement.most_local, side.rows.dtype)
    import_deep_ep()
    _join(side, "nccl")
    serve_deepep(side.world, side.placement, side.expert_fn, side.rows.hidden, side.top_k,
                 settings)


def _join(side: ExpertSide, backend: str) -> None:
    """Join the world's process group (gloo or NCCL), then say the rank is ready."""
    from ep_dispatch.torch_dist import join as join_world

    join_world(side.world, side.rendezvous_timeout, backend, side.rows)
    side.ready()


@dataclass(frozen=True)
class Backend:
    """One dispatch backend: both sides and what it can do. Nothing outside this module
    compares a backend's name; callers ask these attributes.

    client: the attention side, built from a `BackendContext`.
    serve: the expert side of a lockstep backend, run on each expert rank until stopped
        (None: the expert service's own TCP server answers, `rpc`; or there are no expert
        services, `local`).
    collective: every rank moves in lockstep through collectives, so all start together
        and no rank restarts alone. in_process: the experts live in the attention process.
    cuda_only: moves CUDA tensors only. mxfp4_rows: moves W4A4's MXFP4 rows.
    deepep_settings: takes the `--deepep-*` settings (and DeepEP's limits on them).
    """

    name: str
    client: Callable[[BackendContext], ExpertsClient]
    serve: Callable[[ExpertSide], None] | None = None
    collective: bool = False
    in_process: bool = False
    cuda_only: bool = False
    mxfp4_rows: bool = True
    deepep_settings: bool = False


_BACKENDS = {b.name: b for b in (
    Backend("local", _local, in_process=True),
    Backend("rpc", _rpc),
    Backend("torch", _torch, _serve_torch, collective=True),
    Backend("nccl", _nccl, _serve_nccl, collective=True, cuda_only=True),
    Backend("deepep", _deepep, _serve_deepep, collective=True, cuda_only=True,
            mxfp4_rows=False, deepep_settings=True),
)}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def backend(name: str, device: str = "cpu", quantization: str | None = None) -> Backend:
    """The backend called `name`, or a clear error for an unknown one, or one that cannot
    move `device`'s tensors or `quantization`'s rows."""
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown dispatch backend {name!r}; available: {', '.join(available_backends())}"
        )
    found = _BACKENDS[name]
    if quantization and not found.mxfp4_rows:
        *most, last = [b.name for b in _BACKENDS.values() if b.mxfp4_rows]
        able = f"{', '.join(most)} and {last}"
        raise ValueError(f"the {name} dispatch backend moves bfloat16 rows (DeepEP's kernels "
                         f"take bf16 or FP8, not MXFP4): --quantization {quantization} works "
                         f"with the {able} backends")
    if found.cuda_only and device != "cuda":
        raise ValueError(f"the {name} dispatch backend moves CUDA tensors: run the services "
                         "with --device cuda")
    return found


def create_experts_client(name: str, ctx: BackendContext) -> ExpertsClient:
    """Build the attention side of the backend called `name` (`backend`'s errors)."""
    return backend(name, ctx.device, ctx.quantization).client(ctx)
