"""The `switchyard` command line: one subcommand per process role, plus `serve` for all."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ep_dispatch.placement import Placement
    from services.model.config import ModelConfig


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from common.flags import env
    from gateway.config import add_access_flags, add_serve_flags
    from services.attention.config import add_engine_flags

    p = sub.add_parser("serve", help="start the whole local topology (gateway + engine)")
    p.add_argument("--model", default=env("MODEL"),
                   help="HF checkpoint directory (default: the bundled demo model)")
    p.add_argument("--served-model-name", default=env("SERVED_MODEL_NAME"),
                   help="model name clients use (default: the directory's name)")
    p.add_argument("--host", default=env("HOST", "127.0.0.1"), help="gateway bind address")
    p.add_argument("--port", type=int, default=int(env("PORT", "8000")),
                   help="gateway HTTP port (0 picks a free one)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds to wait for the services to become healthy")
    p.add_argument("--expert-services", type=int, default=None,
                   help="expert service processes (default: 2, or 0 with --dispatch-backend "
                        "local, which keeps the experts inside the attention service)")
    p.add_argument("--attention-groups", type=int, default=int(env("ATTENTION_GROUPS", "1")),
                   help="attention services sharing the expert services (data parallel)")
    add_serve_flags(p)
    add_access_flags(p)
    add_engine_flags(p, default_backend="rpc")


def _placement_parser(sub: argparse._SubParsersAction) -> None:
    from common.flags import add_replicas_flag

    p = sub.add_parser("placement", help="print which expert service holds which experts, "
                       "or balance them by measured load (DeepSeek's EPLB)")
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--expert-services", type=int, default=2)
    p.add_argument("--placement", default=None, help="check and print this placement file")
    add_replicas_flag(p)
    p.add_argument("--load", default=None, metavar="URL|FILE",
                   help="balance by this routing load: a running server's URL (its /stats), "
                        "or a JSON file holding /stats' expert_load (per layer, per expert)")
    p.add_argument("--num-redundant-experts", type=int, default=0,
                   help="with --load: copies beyond one per expert, given to the heaviest")
    p.add_argument("--num-groups", type=int, default=None,
                   help="with --load: expert groups kept together (default: the model's "
                        "n_group where it routes by group, else 1)")
    p.add_argument("--num-nodes", type=int, default=1,
                   help="with --load: nodes the expert services span (EPLB's hierarchy)")
    p.add_argument("--json", action="store_true", help="print the JSON form (to edit and load)")


def _placement(args: argparse.Namespace) -> int:
    from ep_dispatch.placement import PlacementError, make_placement
    from services.model.config import CheckpointError, ModelConfig

    try:
        cfg = ModelConfig.from_dir(args.model)
        if args.load:
            placement = _balanced_by_load(args, cfg)
        else:
            placement = make_placement(cfg.served_moe_layers(),
                                       cfg.num_experts, args.expert_services, args.placement,
                                       args.expert_replicas)
    except (CheckpointError, PlacementError, OSError, ValueError) as exc:
        print(f"switchyard placement: {exc}", file=sys.stderr)
        return 2
    print(placement.to_json() if args.json else placement.describe())
    return 0


def _balanced_by_load(args: argparse.Namespace, cfg: ModelConfig) -> Placement:
    """EPLB's placement for the routing load at `--load` (`ep_dispatch.eplb`)."""
    import json
    from pathlib import Path

    import httpx
    import torch

    from ep_dispatch.eplb import placement_from_load

    if args.load.startswith(("http://", "https://")):
        stats = httpx.get(f"{args.load.rstrip('/')}/stats", timeout=30).raise_for_status().json()
    else:
        stats = json.loads(Path(args.load).read_text())
    rows = stats.get("expert_load") if isinstance(stats, dict) else None
    full = cfg.num_layers + cfg.mtp_layers  # the MTP layers' rows carry their drafts' load
    if not isinstance(rows, list) or len(rows) not in (cfg.num_layers, full):
        raise ValueError(f"{args.load}: no expert_load of {full} layers (as the gateway's "
                         f"/stats gives it)")
    layers = cfg.served_moe_layers(mtp=len(rows) == full)
    load = torch.tensor([rows[i] for i in layers], dtype=torch.float64)
    routing = cfg.routing_spec
    groups = args.num_groups or (routing.n_group if routing.method != "greedy" else 1)
    return placement_from_load(load, layers, args.expert_services,
                               args.num_redundant_experts, groups, args.num_nodes)


# Subcommands with parsers of their own, run by module; imported only when chosen, so that
# a healthcheck (`probe`) loads only what it runs.
OWN_PARSERS = {"gateway": "gateway.server", "eval": "switchyard.eval",
               "bench": "switchyard.bench", "compose": "switchyard.compose",
               "k8s": "switchyard.k8s",
               "probe": "switchyard.probe", "quantize": "services.expert.quantize"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in OWN_PARSERS:
        return importlib.import_module(OWN_PARSERS[argv[0]]).main(argv[1:]) or 0
    # The service flags need no torch; the services import it when they start.
    from services.attention.config import add_attention_parser, from_args
    from services.expert.config import add_expert_parser, expert_config

    parser = argparse.ArgumentParser(prog="switchyard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    add_attention_parser(sub)
    add_expert_parser(sub)
    _placement_parser(sub)
    sub.add_parser("gateway", help="run the HTTP gateway (see `switchyard gateway --help`)")
    sub.add_parser("eval", help="demo-task accuracy through the chat API (`switchyard eval -h`)")
    sub.add_parser("bench", help="serving load generator and latency report (`... bench -h`)")
    sub.add_parser("quantize", help="write a W4A4 (MXFP4 experts) copy of a checkpoint")
    sub.add_parser("compose", help="render the docker compose file for a GPU layout")
    sub.add_parser("k8s", help="render the Kubernetes (LeaderWorkerSet) manifests of a layout")
    sub.add_parser("probe", help="healthcheck: is this URL or service answering?")
    args = parser.parse_args(argv)
    if args.command == "serve":
        from switchyard.launcher import serve

        return serve(args)
    if args.command == "placement":
        return _placement(args)
    try:
        config = expert_config(args) if args.command == "expert" else from_args(args)
    except ValueError as exc:
        print(f"switchyard {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.command == "expert":
        from services.expert.server import main as expert_main

        return expert_main(config)
    from services.attention.server import main as attention_main

    return attention_main(config)
