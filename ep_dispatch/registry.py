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


_BACKENDS: dict[str, Callable[[BackendContext], ExpertsClient]] = {
    "local": _local, "rpc": _rpc, "torch": _torch, "nccl": _nccl, "deepep": _deepep}
# Backends whose ranks move in lockstep through collectives (the launcher starts every
# rank together), and those that move CUDA tensors only.
COLLECTIVE = ("torch", "nccl", "deepep")
CUDA_ONLY = ("nccl", "deepep")


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def check_backend(name: str, device: str = "cpu", quantization: str | None = None) -> None:
    """A clear error for an unknown backend, or one that cannot move `device`'s tensors or
    `quantization`'s rows."""
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown dispatch backend {name!r}; available: {', '.join(available_backends())}"
        )
    if quantization and name == "deepep":
        raise ValueError(f"the deepep dispatch backend moves bfloat16 rows (DeepEP's kernels "
                         f"take bf16 or FP8, not MXFP4): --quantization {quantization} works "
                         "with the local, rpc, torch and nccl backends")
    if name in CUDA_ONLY and device != "cuda":
        raise ValueError(f"the {name} dispatch backend moves CUDA tensors: run the services "
                         "with --device cuda")


def create_experts_client(name: str, ctx: BackendContext) -> ExpertsClient:
    """Build the backend called `name`; unknown names get an error listing the known ones."""
    check_backend(name, ctx.device, ctx.quantization)
    return _BACKENDS[name](ctx)
