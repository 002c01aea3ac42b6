"""Dispatch backends by name.

A backend's packages, torch among them, are imported only when the backend is built. So
`switchyard serve` can check a backend's name without them.

Each backend is one `Backend` object. It is built from the model's `MoESeam` and its own
frozen settings: `InProcessSettings`, `RpcSettings`, or `WorldSettings`, which include
DeepEP's. A `Backend` holds:

- its attention-side client;
- its expert side, `serve`, which the expert service runs. For `rpc` this is
  `rpc_server`, a TCP listener whose queue coalesces each layer's batches. The lockstep
  backends join their world's rounds;
- its capabilities as attributes: `collective`, `in_process`, `cuda_only`, `mxfp4_rows`,
  `deepep_settings` and `mtp`.

Nothing outside the registry compares a backend's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.auth import NO_SECRET, ClusterSecret
from common.device import collective_backend
from common.rpc import LINK_TIMEOUT_S

if TYPE_CHECKING:
    import torch

    from ep_dispatch.base import DeviceExpertFn, ExpertFn, ExpertsClient, LayerFn
    from ep_dispatch.deepep_config import DeepEPSettings
    from ep_dispatch.placement import Placement
    from ep_dispatch.rpc_server import RpcListen
    from ep_dispatch.torch_dist import World
    from ep_dispatch.wire import RowFormat


def _float32() -> torch.dtype:
    import torch

    return torch.float32


@dataclass(frozen=True)
class MoESeam:
    """The model's MoE layers as every backend sees them.

    It says what is routed, what travels, and where the experts are placed. The placement
    comes from a JSON placement file, or else is balanced with `replicas` copies of each
    expert.
    """

    moe_layers: list[int]
    num_experts: int
    hidden_size: int = 0
    top_k: int = 0  # experts per token; `deepep` pads empty ranks with it
    dtype: torch.dtype = field(default_factory=_float32)
    quantization: str | None = None  # with "w4a4", activations travel as MXFP4
    device: str = "cpu"  # where the activations live
    placement_file: Path | None = None
    replicas: int = 1

    def placement(self, num_ranks: int) -> Placement:
        from ep_dispatch.placement import make_placement

        return make_placement(self.moe_layers, self.num_experts, num_ranks,
                              self.placement_file, self.replicas)

    @property
    def rows(self) -> RowFormat:
        from ep_dispatch.wire import RowFormat

        return RowFormat(self.hidden_size, self.dtype, self.quantization)


@dataclass(frozen=True)
class InProcessSettings:
    """Settings for `local`, where the attention process holds the experts.

    The functions are `ExpertBank.forward`, `forward_on_device` for CUDA graphs, and
    `forward_layer`, which runs a layer in one call.
    """

    expert_fn: ExpertFn
    device_expert_fn: DeviceExpertFn | None = None
    layer_fn: LayerFn | None = None


@dataclass(frozen=True)
class RpcSettings:
    """Settings for `rpc`: one (host, port) per expert rank, and how long to wait for them."""

    addresses: list[tuple[str, int]]
    call_timeout: float = 30.0
    connect_timeout: float = 30.0
    secret: ClusterSecret = NO_SECRET  # what each connection proves; see `common.auth`
    link_timeout: float = LINK_TIMEOUT_S  # a rank silent this long is lost; see set_liveness


@dataclass(frozen=True)
class WorldSettings:
    """Settings for the lockstep backends: `torch`, `nccl` and `deepep`.

    They hold this rank's place among all ranks, how long all ranks may take to join, and
    `deepep`'s `--deepep-*` settings.
    """

    world: World
    rendezvous_timeout: float = 300.0
    deepep: DeepEPSettings | None = None


@dataclass(frozen=True)
class BackendSettings:
    """Each backend's own settings, as the flags gave them.

    None means no flag set them. A backend reads only its own settings, and names the
    flags it misses.
    """

    in_process: InProcessSettings | None = None
    rpc: RpcSettings | None = None
    world: WorldSettings | None = None


def _local(seam: MoESeam, settings: BackendSettings) -> ExpertsClient:
    from ep_dispatch.local import LocalExperts

    if (own := settings.in_process) is None:
        raise ValueError("the local backend needs the experts in this process")
    return LocalExperts(seam.num_experts, own.expert_fn, seam.quantization,
                        own.device_expert_fn, own.layer_fn)


def _rpc(seam: MoESeam, settings: BackendSettings) -> ExpertsClient:
    from ep_dispatch.rpc import RpcExperts

    if (own := settings.rpc) is None or not own.addresses:
        raise ValueError("the rpc backend needs --expert-addresses HOST:PORT,...")
    return RpcExperts(seam.placement(len(own.addresses)), own.addresses, own.call_timeout,
                      own.connect_timeout, seam.quantization, own.secret, own.link_timeout)


def _world(name: str, settings: BackendSettings) -> WorldSettings:
    if settings.world is None:
        raise ValueError(f"the {name} backend needs --dist-init HOST:PORT and the rank layout")
    return settings.world


def _torch(seam: MoESeam, settings: BackendSettings) -> ExpertsClient:
    from ep_dispatch.torch_dist import TorchExperts, join

    own = _world("torch", settings)
    join(own.world, own.rendezvous_timeout, collective_backend(seam.device), seam.rows)
    return TorchExperts(own.world, seam.placement(own.world.num_experts), seam.rows,
                        seam.device)


def _nccl(seam: MoESeam, settings: BackendSettings) -> ExpertsClient:
    from ep_dispatch.nccl import CupyNccl, import_nccl
    from ep_dispatch.torch_dist import TorchExperts

    import_nccl()
    own = _world("nccl", settings)
    return TorchExperts(own.world, seam.placement(own.world.num_experts), seam.rows,
                        seam.device, CupyNccl(own.world, own.rendezvous_timeout, seam.rows),
                        backend="nccl")


def _deepep(seam: MoESeam, settings: BackendSettings) -> ExpertsClient:
    from ep_dispatch.deepep import DeepEPExperts
    from ep_dispatch.deepep_config import DeepEPSettings, check_deepep, import_deep_ep
    from ep_dispatch.torch_dist import join

    own = _world("deepep", settings)
    placement = seam.placement(own.world.num_experts)
    deepep = own.deepep or DeepEPSettings()
    check_deepep(deepep, own.world.size, seam.hidden_size, seam.top_k, placement.most_local,
                 seam.dtype)
    import_deep_ep()
    join(own.world, own.rendezvous_timeout, "nccl", seam.rows)
    return DeepEPExperts(own.world, placement, seam.hidden_size, seam.top_k, deepep)


@dataclass(frozen=True)
class ExpertSide:
    """What one expert rank serves with, whatever the backend. Each backend reads its share.

    - placement: every rank's experts.
    - expert_fn: this rank's experts, as `ExpertBank.forward`.
    - rows: what travels.
    - ready: called once the rank serves, with the port it bound. The port is 0 when there
      is none, because a lockstep backend's rank joined its world.
    - world: the lockstep backends' settings.
    - listen: `rpc`'s settings, saying where to listen and what answers there.
    """

    placement: Placement
    expert_fn: ExpertFn
    rows: RowFormat
    device: str
    top_k: int
    ready: Callable[[int], None]
    world: WorldSettings | None = None
    listen: RpcListen | None = None


def _serve_rpc(side: ExpertSide) -> None:
    import anyio

    from ep_dispatch.rpc_server import serve_rpc

    if side.listen is None:
        raise ValueError("the rpc backend's expert side needs its listener's settings")
    anyio.run(serve_rpc, side.listen, side.ready)


def _side_world(name: str, side: ExpertSide) -> WorldSettings:
    if side.world is None:
        raise ValueError(f"--dispatch-backend {name} needs --dist-init HOST:PORT")
    return side.world


def _serve_torch(side: ExpertSide) -> None:
    from ep_dispatch.torch_dist import serve_experts

    own = _side_world("torch", side)
    _join(side, own, collective_backend(side.device))
    serve_experts(own.world, side.placement, side.expert_fn, side.rows, side.device)


def _serve_nccl(side: ExpertSide) -> None:
    from ep_dispatch.nccl import CupyNccl
    from ep_dispatch.torch_dist import serve_experts

    own = _side_world("nccl", side)
    collective = CupyNccl(own.world, own.rendezvous_timeout, side.rows)
    side.ready(0)
    serve_experts(own.world, side.placement, side.expert_fn, side.rows, side.device,
                  collective)


def _serve_deepep(side: ExpertSide) -> None:
    from ep_dispatch.deepep import serve_deepep
    from ep_dispatch.deepep_config import DeepEPSettings, check_deepep, import_deep_ep

    own = _side_world("deepep", side)
    settings = own.deepep or DeepEPSettings()
    check_deepep(settings, own.world.size, side.rows.hidden, side.top_k,
                 side.placement.most_local, side.rows.dtype)
    import_deep_ep()
    _join(side, own, "nccl")
    serve_deepep(own.world, side.placement, side.expert_fn, side.rows.hidden, side.top_k,
                 settings)


def _join(side: ExpertSide, own: WorldSettings, backend: str) -> None:
    """Join the world's gloo or NCCL process group, then say the rank is ready."""
    from ep_dispatch.torch_dist import join as join_world

    join_world(own.world, own.rendezvous_timeout, backend, side.rows)
    side.ready(0)


@dataclass(frozen=True)
class Backend:
    """One dispatch backend: both sides and what it can do. Nothing outside this module
    compares a backend's name; callers ask these attributes.

    client: the attention side. It is built from the model's `MoESeam` and the backend's
        own settings, taken from the `BackendSettings` the flags gave.
    serve: the expert side, run on each expert rank until stopped. For `rpc` it is a TCP
        listener, `ep_dispatch/rpc_server.py`. The lockstep backends run their world's
        rounds. None means there are no expert services, as with `local`.
    collective: every rank moves in lockstep through collectives. So all ranks start
        together, and no rank restarts alone.
    in_process: the experts live in the attention process.
    cuda_only: the backend moves CUDA tensors only.
    mxfp4_rows: the backend moves W4A4's MXFP4 rows.
    deepep_settings: the backend takes the `--deepep-*` settings, with DeepEP's limits
        on them.
    movable: the backend moves experts between its expert ranks while serving, for EPLB's
        rebalances.
    mtp: its expert ranks also hold a checkpoint's MTP layers. MTP drafts call those
        apart from a step's decoder layers. `deepep`'s rounds take only the decoder's.
    """

    name: str
    client: Callable[[MoESeam, BackendSettings], ExpertsClient]
    serve: Callable[[ExpertSide], None] | None = None
    collective: bool = False
    in_process: bool = False
    cuda_only: bool = False
    mxfp4_rows: bool = True
    deepep_settings: bool = False
    movable: bool = False
    mtp: bool = True


_BACKENDS = {b.name: b for b in (
    Backend("local", _local, in_process=True),
    Backend("rpc", _rpc, _serve_rpc, movable=True),
    Backend("torch", _torch, _serve_torch, collective=True),
    Backend("nccl", _nccl, _serve_nccl, collective=True, cuda_only=True),
    Backend("deepep", _deepep, _serve_deepep, collective=True, cuda_only=True, mtp=False,
            mxfp4_rows=False, deepep_settings=True),
)}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def expert_side_backends() -> list[str]:
    """The backends an expert service can serve, which are those with expert services."""
    return sorted(name for name, b in _BACKENDS.items() if b.serve is not None)


def backend(name: str, device: str = "cpu", quantization: str | None = None) -> Backend:
    """The backend called `name`.

    Raises a clear error for an unknown name, or for a backend that cannot move `device`'s
    tensors or `quantization`'s rows.
    """
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


def create_experts_client(name: str, seam: MoESeam,
                          settings: BackendSettings = BackendSettings()) -> ExpertsClient:
    """Build the attention side of the backend called `name`.

    Raises the errors that `backend` raises.
    """
    return backend(name, seam.device, seam.quantization).client(seam, settings)
