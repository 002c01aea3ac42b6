"""One MoE layer call at a few tokens: the `rpc` backend's round trip to expert services
against the same experts in this process (`local`), side by side, rounds alternating.

    .venv/bin/python -m benchmarks.round_trip [--expert-services 2] [--tokens 1]
                                              [--num-threads 2] [--rounds 2] [--tiny]

The mid-size checkpoint of `benchmarks.generate` (float32), or with `--tiny` one of the
same layout at hidden 64, whose experts cost next to nothing: what is left is the
exchange itself (rows made bytes, the sends, each service waking, decoding, handing the
batch to its compute thread, and back). Every process runs with `OMP_WAIT_POLICY=PASSIVE`,
as `switchyard serve` runs its services when they share the cores: a caller whose idle
OpenMP workers spin takes the cores the expert services compute on. Each token goes to
the same top-k experts, spread over the services. Prints the median milliseconds a call
over every MoE layer, per round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.generate import add_workdir_flag, build_checkpoint
from ep_dispatch.local import LocalExperts
from ep_dispatch.placement import make_placement
from ep_dispatch.rpc import RpcExperts
from services.model.checkpoint import Checkpoint
from services.model.config import ModelConfig
from services.model.experts import ExpertBank
from switchyard.children import Children

CALLS = 300  # timed passes over the MoE layers, a round


def tiny_checkpoint(workdir: Path) -> Path:
    """The mid-size checkpoint's routing (32 experts, top-4) at hidden 64, 2 layers."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    path = workdir / "qwen3-moe-tiny-exchange"
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                moe_intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                num_experts=32, num_experts_per_tok=4, norm_topk_prob=True)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def median_ms(call: Callable[[int], object], layers: list[int]) -> float:
    for layer in layers * 20:  # warm-up
        call(layer)
    times = []
    for _ in range(CALLS):
        for layer in layers:
            start = time.perf_counter()
            call(layer)
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workdir_flag(ap)
    ap.add_argument("--expert-services", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--num-threads", type=int, default=2, help="each process's threads")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="hidden 64: the exchange alone")
    args = ap.parse_args()
    if os.environ.get("OMP_WAIT_POLICY") != "PASSIVE":  # read once, as OpenMP loads
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.round_trip",
                                   *sys.argv[1:]], {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    path = tiny_checkpoint(args.workdir) if args.tiny else build_checkpoint(args.workdir)
    torch.set_num_threads(args.num_threads)
    cfg = ModelConfig.from_dir(path)
    layers, n = cfg.moe_layer_ids, args.expert_services
    children = Children()
    try:
        pending = [children.spawn(f"expert rank {r}", [
            "expert", "--model", str(path), "--rank", str(r), "--num-ranks", str(n),
            "--port", "0", "--num-threads", str(args.num_threads)]) for r in range(n)]
        deadline = time.monotonic() + 300
        ports = [children.wait_ports(p, deadline)[0] for p in pending]
        rpc = RpcExperts(make_placement(layers, cfg.num_experts, n, None, 1),
                         [("127.0.0.1", p) for p in ports])
        everything = make_placement(layers, cfg.num_experts, 1, None, 1).local_experts(0)
        checkpoint = Checkpoint(path)
        bank = ExpertBank(cfg, checkpoint, everything, torch.float32, "auto")
        checkpoint.close()
        local = LocalExperts(cfg.num_experts, bank.forward)
        x = torch.randn(args.tokens, cfg.hidden_size)  # [T, H]
        ids = torch.arange(cfg.top_k).repeat(args.tokens, 1)  # [T, K]: experts 0..K-1
        weights = torch.full((args.tokens, cfg.top_k), 1 / cfg.top_k)  # [T, K]
        print(f"{path.name}, {args.tokens} token(s), top-{cfg.top_k} over {n} expert "
              f"services, {args.num_threads} thread(s) a process; median ms a layer call:")
        with torch.inference_mode():
            for r in range(args.rounds):
                row = {name: median_ms(lambda layer, e=experts: e(layer, x, ids, weights),
                                       layers)
                       for name, experts in (("rpc", rpc), ("local", local))}
                print(f"  round {r + 1}: rpc {row['rpc']:.3f}, local {row['local']:.3f}, "
                      f"rpc - local {row['rpc'] - row['local']:.3f}", flush=True)
        rpc.close()
    finally:
        children.stop()


if __name__ == "__main__":
    main()
