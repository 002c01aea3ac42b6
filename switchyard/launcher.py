"""`switchyard serve`: start every service of the local topology as child processes.

Start-up is ordered by readiness, not by sleeps. Each child writes its bound port to a
pipe once it listens, and the gateway's `/health` must answer 200 before the URL is
printed. It does so once a warm-up generation went through every attention group and every
expert rank; a failed warm-up stops `serve`, naming the service and its error. Ctrl-C or
SIGTERM stops every child. Children also die with the launcher (PR_SET_PDEATHSIG), so none
is orphaned.

Each service is given fixed ports, so that it is found again after a restart, and writes its
bound port and its `/metrics` port to the pipe named by `--ready-fd`. The expert services
start first, then the attention groups, given the experts' addresses, then the gateway,
given the groups' addresses. With the `torch`, `nccl` or `deepep` backend the expert and
attention ranks start together, because their rendezvous needs every rank. A failed warm-up
stops `serve` with exit status 1, and its error names the attention service and, through the
engine's error, the expert rank and its cause.

The flags (backend, device, quantization, placement, DeepEP's limits) are checked before
anything starts. torch is imported only where the launcher asks about a CUDA device, about
DeepEP's limits or about W4A4's block sizes (`--quantization w4a4`): the config modules,
`ep_dispatch.registry`, `placement` and `deepep_config` import torch where a tensor is made,
not at import. When float experts are served on the CPU, neither the launcher nor the
gateway maps libtorch, as tested; that saves each `serve` about 2 s of start-up.

A `--port 0` is resolved to a free port at start, so the URL printed stays true when the
gateway is started again. The restart policy is `switchyard.supervisor`'s. `_restart_units`
here kills a unit's surviving members with SIGKILL and starts the unit again together.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from common.auth import SECRET_ENV, ClusterSecret
from common.device import check_device, resolve_dtype
from common.flags import ENV_PREFIX
from common.ports import http_url
from ep_dispatch.deepep_config import deepep_settings
from ep_dispatch.placement import Placement, make_placement
from ep_dispatch.registry import Backend, backend
from gateway.config import access_flags, access_settings, eplb_config, serve_flags
from gateway.generation_config import SamplingDefaults
from gateway.routing.engine_pool import WARMUP_FAILED
from services.attention.config import check_cuda_graphs
from services.model.config import CheckpointError, ModelConfig, check_quantization
from switchyard.children import Children, StartupError
from switchyard.demo_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from switchyard.local import render
from switchyard.supervisor import Unit, supervise


def _wait_healthy(url: str, children: Children, timeout: float,
                  args: argparse.Namespace) -> None:
    """Wait until `url`, the gateway's /health, answers 200: every group has warmed up. A
    warm-up that failed ends the wait at once, with its error, which names the service.
    Over HTTPS the gateway is our own child, so its certificate is not checked; where it
    wants client certificates, its own is presented."""
    deadline = time.monotonic() + timeout
    delay, said = 0.05, "no answer"
    cert = (args.ssl_certfile, args.ssl_keyfile) if args.ssl_ca_certs else None
    with httpx.Client(timeout=5.0, verify=False, cert=cert) as client:
        while time.monotonic() < deadline:
            children.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                answer = client.get(url)
                if answer.status_code == 200:
                    return
                said = _error_message(answer)
                if WARMUP_FAILED in said:
                    raise StartupError(said[said.index(WARMUP_FAILED):])
            select.select([], [], [], delay)
            delay = min(delay * 2, 1.0)
    raise StartupError(f"{url} did not answer 200 within {timeout:.0f}s (last: {said})")


def _error_message(answer: httpx.Response) -> str:
    """An OpenAI-shaped error body's message, else the status and text."""
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"{answer.status_code} {answer.text[:200]}"


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM and SIGINT both stop the topology. SIGINT explicitly: a process started in
    the background by a shell inherits SIGINT as ignored, and Python then leaves it so."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _num_expert_services(args: argparse.Namespace) -> int:
    if backend(args.dispatch_backend).in_process:
        if args.expert_services:
            raise StartupError("--dispatch-backend local keeps the experts in the attention "
                               "service; it cannot use --expert-services")
        return 0
    n = 2 if args.expert_services is None else args.expert_services
    if n < 1:
        raise StartupError(f"--dispatch-backend {args.dispatch_backend} needs at least one "
                           f"expert service")
    return n


def _start_services(args: argparse.Namespace, model: Path, name: str,
                    children: Children) -> str:
    """Start experts, then attention groups, then the gateway, and return the gateway URL.
    A collective world's expert and attention ranks start at once."""
    timeout = args.startup_timeout
    num_experts = _num_expert_services(args)
    if args.attention_groups < 1:
        raise StartupError("--attention-groups must be at least 1")
    if args.dcp_size < 1:
        raise StartupError("--dcp-size must be at least 1")
    if num_experts:
        # Several compute processes share the cores, so OpenMP's default spin-wait after
        # each parallel region would burn the cores the others need. Measured with the
        # torch backend and 2 expert services: 0.35x -> 1.02x of single-process tokens/s.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    access, keys = access_flags(args)
    try:
        services = render(args, model, name, num_experts, access)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
    if services.world:  # one process group: every rank at once, for its rendezvous
        children.start_all(services.experts + services.attention, timeout, gpu=True)
    else:  # a DCP group's ranks start together: their rendezvous needs all of them
        children.start_all(services.experts, timeout, gpu=True)
        children.start_all(services.attention, timeout, gpu=True)
    [(http_port,)] = children.start_all([services.gateway], timeout, env=keys)
    url = http_url(args.host, http_port, https=bool(args.ssl_certfile))
    _wait_healthy(f"{url}/health", children, timeout, args)
    return url


@contextlib.contextmanager
def _cluster_secret() -> Iterator[None]:
    """Every child proves the same secret on its connections. It is the one the
    environment names (SWITCHYARD_CLUSTER_SECRET_FILE), or a random one made for this run,
    in a file only this user can read, removed at the end."""
    variable = ENV_PREFIX + SECRET_ENV
    if os.environ.get(variable):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="switchyard-") as tmp:
        os.environ[variable] = str(ClusterSecret.generate().write(Path(tmp) / "secret"))
        try:
            yield
        finally:
            del os.environ[variable]


def _restart_units(args: argparse.Namespace, names: list[str]) -> dict[str, Unit]:
    """Which children `serve` starts again together when one of them dies.

    A rendezvous needs all its members, so a collective backend's world, every attention
    and expert rank, restarts whole, and a DCP group restarts with all its ranks. An `rpc`
    expert service, a group without DCP, and the gateway restart alone.
    """
    services = [n for n in names if n != "gateway"]
    gateway = {"gateway": ("gateway",)} if "gateway" in names else {}
    if backend(args.dispatch_backend).collective:
        return {**dict.fromkeys(services, tuple(services)), **gateway}
    group = {n: n.split(" DCP rank ")[0] for n in services}  # a DCP peer: its leader's name
    return {**{n: tuple(m for m in services if group[m] == group[n]) for n in services},
            **gateway}


def _check_generation_config(source: str, model: Path) -> None:
    """What the gateway will read, checked before any service loads the model."""
    try:
        SamplingDefaults.load(source, model)
    except ValueError as exc:
        raise ValueError(f"--generation-config: {exc}") from exc


def _check_deepep(args: argparse.Namespace, cfg: ModelConfig, placement: Placement) -> None:
    """DeepEP's limits for this layout and model, and DeepEP itself, before any process."""
    import torch

    from ep_dispatch.deepep_config import (
        check_deepep,
        check_slots_fit,
        check_step_budget,
        import_deep_ep,
    )
    world = args.attention_groups + placement.num_ranks
    settings = deepep_settings(args)
    check_deepep(settings, world, cfg.hidden_size, cfg.top_k, placement.most_local,
                 resolve_dtype(args.dtype, args.device))
    check_step_budget(settings, args.max_num_batched_tokens)
    check_slots_fit(settings, world * placement.most_local,
                    torch.cuda.get_device_properties(0).multi_processor_count)
    import_deep_ep()


def _gpus(args: argparse.Namespace, num_experts: int) -> int:
    """GPUs to spread the services over, 0 on the CPU. NCCL gives each rank its own GPU,
    so collective backends and DCP need one per rank; rpc services may share."""
    if args.device != "cuda":
        return 0
    import torch

    have = torch.cuda.device_count()
    collective = backend(args.dispatch_backend).collective
    ranks = args.attention_groups * args.dcp_size + (num_experts if collective else 0)
    if (collective or args.dcp_size > 1) and ranks > have:
        raise StartupError(f"{ranks} NCCL ranks need as many GPUs; {have} visible "
                           "(rpc services without DCP can share GPUs)")
    return have


def _check_eplb(args: argparse.Namespace, cfg: ModelConfig, dispatch: Backend,
                num_experts: int) -> None:
    """`--enable-eplb` needs expert services that can move (rpc), and EPLB's copies,
    experts plus redundant ones, must spread evenly over them."""
    eplb_config(args)  # its flags' own ranges first
    if not args.enable_eplb:
        return
    if not dispatch.movable:
        raise StartupError(f"--enable-eplb moves experts between rpc expert services; the "
                           f"{args.dispatch_backend} dispatch backend cannot")
    copies = cfg.num_experts + args.num_redundant_experts
    if copies % num_experts:
        raise StartupError(f"--num-redundant-experts {args.num_redundant_experts}: "
                           f"{cfg.num_experts} experts + {args.num_redundant_experts} "
                           f"copies do not spread evenly over {num_experts} expert services")


def serve(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else DEFAULT_MODEL
    name = args.served_model_name or (model.name if args.model else DEFAULT_MODEL_NAME)
    try:
        # Fail fast on the common mistakes, before any process starts.
        cfg = ModelConfig.from_dir(model)
        check_device(args.device, "attention")
        check_cuda_graphs(args.cuda_graph_max_batch, args.cuda_graph_max_len, args.device,
                          args.dispatch_backend, args.dcp_size)
        quantization = check_quantization(cfg, args.quantization)
        dispatch = backend(args.dispatch_backend, args.device, quantization)
        if num_experts := _num_expert_services(args):
            placement = make_placement(cfg.served_moe_layers(dispatch.mtp),
                                       cfg.num_experts, num_experts,
                                       args.placement, args.expert_replicas)
            if dispatch.deepep_settings:  # a collective backend, which has experts
                _check_deepep(args, cfg, placement)
        _check_eplb(args, cfg, dispatch, num_experts)
        _check_generation_config(args.generation_config, model)
        serve_flags(args)
        access_settings(args, args.host)
    except (CheckpointError, ValueError, StartupError, OSError) as exc:
        print(f"switchyard serve: {exc}", file=sys.stderr)
        return 2
    try:
        children = Children(_gpus(args, _num_expert_services(args)))
    except StartupError as exc:
        print(f"switchyard serve: {exc}", file=sys.stderr)
        return 2
    with _stop_on_signals(), _cluster_secret():
        try:
            url = _start_services(args, model, name, children)
            print(f"Switchyard is serving {name!r} at {url}/v1", flush=True)
            units = _restart_units(args, [n for n, _ in children.procs])
            supervise(children, lambda child: units.get(child, ()))
        except StartupError as exc:
            print(f"switchyard serve: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            children.stop()
    return 0
