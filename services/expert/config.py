"""ExpertConfig: one expert service's settings, built once from flags and environment."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from common.auth import NO_SECRET, ClusterSecret, add_secret_flag
from common.flags import (
    add_device_flag,
    add_link_timeout_flag,
    add_metrics_flag,
    add_quantization_flag,
    add_rendezvous_flag,
    add_replicas_flag,
    env,
)
from common.rpc import LINK_TIMEOUT_S, parse_address
from ep_dispatch.deepep_config import DeepEPSettings, add_deepep_flags, deepep_settings
from ep_dispatch.registry import expert_side_backends


@dataclass(frozen=True)
class ExpertConfig:
    model: Path
    rank: int
    num_ranks: int
    placement: Path | None = None  # JSON file; balanced when absent
    expert_replicas: int = 1  # balanced: each expert on this many ranks
    dtype: str = "auto"
    num_threads: int | None = None
    host: str = "127.0.0.1"
    port: int = 0
    ready_fd: int | None = None
    dispatch_backend: str = "rpc"  # rpc: serve TCP; torch: join the collective world
    dist_init: tuple[str, int] | None = None
    attention_ranks: int = 1
    rendezvous_timeout: float = 300.0
    quantization: str = "auto"  # auto (the checkpoint's), none or w4a4
    otlp_traces_endpoint: str | None = None
    metrics_port: int | None = None  # Prometheus /metrics; None: not served
    device: str = "cpu"
    deepep: DeepEPSettings = field(default_factory=DeepEPSettings)
    secret: ClusterSecret = NO_SECRET  # what connections to --port prove (`common.auth`)
    link_timeout: float = LINK_TIMEOUT_S  # a peer silent this long is dead (`set_liveness`)


def add_expert_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("expert", help="run one expert service (a share of the experts)")
    p.add_argument("--model", default=env("MODEL"), required=env("MODEL") is None,
                   help="HF checkpoint directory")
    p.add_argument("--rank", type=int, default=int(env("EXPERT_RANK", "0")),
                   help="this service's expert rank, 0..num-ranks-1")
    p.add_argument("--num-ranks", type=int, default=int(env("EXPERT_RANKS", "1")),
                   help="number of expert services")
    p.add_argument("--placement", "--expert-placement", default=env("PLACEMENT"),
                   help="placement JSON file (default: balanced round-robin)")
    add_replicas_flag(p)
    p.add_argument("--dtype", default=env("DTYPE", "auto"))
    add_device_flag(p)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--host", default=env("EXPERT_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("EXPERT_PORT", "0")))
    p.add_argument("--ready-fd", type=int, default=None)
    p.add_argument("--dispatch-backend", default=env("DISPATCH_BACKEND", "rpc"),
                   choices=expert_side_backends(),
                   help="rpc: serve attention ranks over TCP; torch: join their process "
                        "group; nccl: their NCCL communicator (CuPy, --device cuda); "
                        "deepep: their DeepEP buffer (--device cuda)")
    p.add_argument("--dist-init", default=env("DIST_INIT"),
                   help="torch backend: HOST:PORT of the rendezvous (attention rank 0)")
    p.add_argument("--attention-ranks", type=int, default=int(env("ATTENTION_RANKS", "1")),
                   help="torch backend: number of attention groups in the world")
    p.add_argument("--world-rank", type=int, default=None,
                   help="torch backend: this service's rank in the world instead of --rank "
                        "(the attention ranks come first: --rank is it less "
                        "--attention-ranks), as a LeaderWorkerSet's worker index gives it")
    add_rendezvous_flag(p)
    add_quantization_flag(p, "w4a4: hold the experts as MXFP4 and take MXFP4 activations")
    p.add_argument("--otlp-traces-endpoint", default=env("OTLP_TRACES_ENDPOINT"),
                   help="OTLP traces URL (or set the OTEL_EXPORTER_OTLP_* variables)")
    add_metrics_flag(p)
    add_deepep_flags(p)
    add_secret_flag(p)
    add_link_timeout_flag(p)


def expert_config(args: argparse.Namespace) -> ExpertConfig:
    rank = args.rank
    if args.world_rank is not None:
        rank = args.world_rank - args.attention_ranks
        if args.dispatch_backend == "rpc" or not 0 <= rank < args.num_ranks:
            raise ValueError(f"--world-rank {args.world_rank}: not an expert rank of a "
                             f"collective world of {args.attention_ranks} attention and "
                             f"{args.num_ranks} expert ranks")
    return ExpertConfig(model=Path(args.model), rank=rank, num_ranks=args.num_ranks,
                        placement=Path(args.placement) if args.placement else None,
                        expert_replicas=args.expert_replicas,
                        dtype=args.dtype, num_threads=args.num_threads, host=args.host,
                        port=args.port, ready_fd=args.ready_fd,
                        dispatch_backend=args.dispatch_backend,
                        dist_init=parse_address(args.dist_init) if args.dist_init else None,
                        attention_ranks=args.attention_ranks,
                        rendezvous_timeout=args.rendezvous_timeout,
                        quantization=args.quantization,
                        otlp_traces_endpoint=args.otlp_traces_endpoint,
                        metrics_port=args.metrics_port, device=args.device,
                        deepep=deepep_settings(args),
                        secret=ClusterSecret.load(args.cluster_secret_file),
                        link_timeout=args.link_timeout)
