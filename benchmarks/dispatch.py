""".venv/bin/python -m benchmarks.dispatch [--expert-ranks 3] [--tokens 1 16 256 4096]
                                        [--hidden 1024 4096] [--iters 20]

Dispatch + combine per layer (torch backend, gloo) vs. a raw all_to_all_single moving the
same rows there and back, side by side in one world of 1 attention + N expert ranks.

Experts are the identity (y = x), so only data movement, layout and combine are timed.
Top-k 8 over 64 experts, balanced placement, float32, random routing (fixed seed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.ports import free_port
from ep_dispatch.layout import compute_layout
from ep_dispatch.placement import Placement
from ep_dispatch.torch_dist import (
    TorchCollective,
    TorchExperts,
    World,
    _serve_layer,
    agree_rounds,
    join,
)
from ep_dispatch.wire import RowFormat

NUM_EXPERTS, TOP_K = 64, 8


def _identity(layer: int, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    return x


def _raw_round(splits: list[int], rows: torch.Tensor, attention: bool) -> None:
    """The baseline: rows there and back with two all_to_all_single, nothing else."""
    world = dist.get_world_size()
    hidden = rows.shape[1]
    if attention:
        dist.all_to_all_single(torch.empty(0, hidden), rows, [0] * world, splits)
        dist.all_to_all_single(torch.empty_like(rows), torch.empty(0, hidden), splits,
                               [0] * world)
    else:
        recv = torch.empty(splits[0], hidden)
        dist.all_to_all_single(recv, torch.empty(0, hidden), [splits[0]] + [0] * (world - 1),
                               [0] * world)
        dist.all_to_all_single(torch.empty(0, hidden), recv, [0] * world,
                               [splits[0]] + [0] * (world - 1))


def _worker(rank: int, args: argparse.Namespace, port: int, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    world = World(("127.0.0.1", port), 1, args.expert_ranks, rank)
    join(world, 120)
    placement = Placement.balanced([0], NUM_EXPERTS, args.expert_ranks)
    cases = [(t, h) for h in args.hidden for t in args.tokens]
    for tokens, hidden in cases:
        for _ in range(args.iters):
            if rank == 0:
                _attention_iteration(placement, world, tokens, hidden, queue)
            else:
                _expert_iteration(placement, world, tokens, hidden)
    dist.destroy_process_group()


def _routing(tokens: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(tokens * 7 + hidden)
    ids = torch.rand(tokens, NUM_EXPERTS, generator=g).topk(TOP_K).indices
    return torch.randn(tokens, hidden, generator=g), ids, torch.rand(tokens, TOP_K,
                                                                       generator=g)


def _attention_iteration(placement: Placement, world: World, tokens: int, hidden: int,
                         queue: mp.Queue) -> None:
    x, ids, w = _routing(tokens, hidden)
    client = TorchExperts(world, placement, RowFormat(hidden, torch.float32))
    client.begin_step(1)  # once per step, shared by all layers: not timed per layer
    dist.barrier()
    start = time.perf_counter()
    client(0, x, ids, w)
    ours = time.perf_counter() - start
    layout = compute_layout(ids, w, placement, 0)
    rows = x[layout.src_token].contiguous()
    dist.broadcast_object_list([layout.rank_counts], src=0)
    dist.barrier()
    start = time.perf_counter()
    _raw_round([0, *layout.rank_counts], rows, attention=True)
    raw = time.perf_counter() - start
    queue.put((tokens, hidden, ours, raw))


def _expert_iteration(placement: Placement, world: World, tokens: int, hidden: int) -> None:
    agree_rounds(0, torch.device("cpu"))  # the step's rounds (untimed on attention)
    dist.barrier()
    rank = world.rank - world.num_attention
    _serve_layer(world, 0, _identity, RowFormat(hidden, torch.float32), torch.device("cpu"),
                 placement.most_local, placement.table(0).num_local[rank],
                 TorchCollective())
    counts: list[list[int] | None] = [None]
    dist.broadcast_object_list(counts, src=0)
    dist.barrier()
    _raw_round([counts[0][rank]], torch.empty(0, hidden), attention=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--expert-ranks", type=int, default=3)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, args, port, queue))
             for r in range(1 + args.expert_ranks)]
    for p in procs:
        p.start()
    results: dict[tuple[int, int], list[tuple[float, float]]] = {}
    total = len(args.tokens) * len(args.hidden) * args.iters
    for i in range(total):
        tokens, hidden, ours, raw = queue.get(timeout=600)
        results.setdefault((tokens, hidden), []).append((ours, raw))
        if (i + 1) % args.iters == 0:
            print(f"  measured tokens={tokens} hidden={hidden}", flush=True)
    for p in procs:
        p.join()
    print(f"\n1 attention + {args.expert_ranks} expert ranks, gloo over loopback, "
          f"top-{TOP_K} of {NUM_EXPERTS}, float32, median of {args.iters} (first dropped)")
    print("| tokens | hidden | MB each way | dispatch+combine ms | raw all_to_all ms | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for (tokens, hidden), rows in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ours = statistics.median(r[0] for r in rows[1:]) * 1e3
        raw = statistics.median(r[1] for r in rows[1:]) * 1e3
        mb = tokens * TOP_K * hidden * 4 / 1e6
        print(f"| {tokens} | {hidden} | {mb:.2f} | {ours:.2f} | {raw:.2f} | "
              f"{ours / raw:.2f}x |")
    os._exit(0)


if __name__ == "__main__":
    main()
