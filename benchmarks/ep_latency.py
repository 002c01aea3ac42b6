""".venv/bin/python -m benchmarks.ep_latency --device cuda --expert-ranks 7 \\
    [--backends torch nccl deepep] [--quantization w4a4] [--json FILE]

Dispatch + combine latency of the lockstep backends across ranks: one process per rank
(one GPU each with --device cuda), the backends built as the services build them.

Defaults are DeepEP's low-latency test shape: 128 tokens per attention rank, hidden 7168,
top-8 of 256 experts, bfloat16. Expert e returns its rows times 1 + (e % 7) / 8 (exact in
bf16; MXFP4 rows decoded first), so a layer returns sum_k w_k * scale(e_k) * x, which is
checked: a row sent to the wrong expert shows. Times one layer's dispatch + combine on
each attention rank (after `begin_step`, synchronised before and after), median and spread
over --iters calls after a warm-up, beside DeepEP's published low-latency figures at the
same number of expert ranks (H800, FP8 dispatch, bf16 combine: docs/legacy.md of
deepseek-ai/DeepEP) where it publishes one. On a CPU (gloo, `torch` backend) it runs the
same code on loopback, for tests.
"""

from __future__ import annotations

import argparse
import json
import os
import queue as queue_module
import statistics
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

from common.ports import free_port
from ep_dispatch.base import ExpertFn
from ep_dispatch.placement import Placement
from ep_dispatch.torch_dist import World

# DeepEP V1 low-latency kernels, 128 tokens x 7168, top-8: EP size -> (dispatch, combine) us
DEEPEP_LL_US = {8: (77, 114), 16: (118, 195), 32: (155, 273), 64: (173, 314),
                128: (192, 369), 256: (194, 360)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backends", nargs="+", default=["torch"],
                    choices=["torch", "nccl", "deepep"])
    ap.add_argument("--attention-ranks", type=int, default=1)
    ap.add_argument("--expert-ranks", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128, help="per attention rank")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--quantization", choices=["w4a4"], default=None)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50, help="timed calls (at least 1)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds for each backend")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    return args


def _dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.device == "cuda" else torch.float32


def scale(expert: torch.Tensor | int) -> torch.Tensor | float:
    """What expert e multiplies by: 1 + (e % 7) / 8, exact in bfloat16."""
    return 1 + (expert % 7) / 8


def _expert_fn(hidden: int, dtype: torch.dtype, local: list[int]) -> ExpertFn:
    """Scale each local expert's rows (global ids `local`) by `scale`; MXFP4 rows decoded."""
    from moe_kernels.mxfp4 import MXFP4Tensor, dequantize

    factors = torch.tensor([scale(e) for e in local])  # [E_local]

    def run(layer: int, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if rows.dtype == torch.uint8:  # MXFP4 rows
            rows = dequantize(MXFP4Tensor.from_rows(rows, hidden)).to(dtype)
        per_row = factors[:len(counts)].repeat_interleave(torch.tensor(counts))  # [M]
        return rows * per_row.to(rows.device, rows.dtype)[:, None]

    return run


def _attention(backend: str, world: World, placement: Placement, args: argparse.Namespace,
               device: torch.device, results: mp.Queue, done: object) -> None:
    """An attention rank: time the calls, report, then stay in the world until the parent
    has every result (leaving earlier breaks the experts' next round, a false failure)."""
    results.put(_time(backend, world, placement, args, device))
    done.wait(args.timeout)  # type: ignore[attr-defined]


def _time(backend: str, world: World, placement: Placement, args: argparse.Namespace,
          device: torch.device) -> dict:
    from ep_dispatch.deepep_config import DeepEPSettings
    from ep_dispatch.registry import (
        BackendSettings,
        MoESeam,
        WorldSettings,
        create_experts_client,
    )
    from moe_kernels.mxfp4 import dequantize, quantize

    dtype = _dtype(args)
    client = create_experts_client(backend, MoESeam(
        moe_layers=[0], num_experts=args.experts, hidden_size=args.hidden, top_k=args.top_k,
        dtype=dtype, quantization=args.quantization, device=args.device), BackendSettings(
        world=WorldSettings(world, deepep=DeepEPSettings(max_tokens=args.tokens))))
    g = torch.Generator(device=device).manual_seed(world.rank)
    x = torch.randn(args.tokens, args.hidden, device=device, generator=g).to(dtype)  # [T, H]
    probs = torch.rand(args.tokens, args.experts, device=device, generator=g)  # [T, E]
    weights, ids = probs.topk(args.top_k)  # [T, K] each
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    values = dequantize(quantize(x)) if args.quantization else x.float()  # what travels
    expected = values * (weights.float() * scale(ids)).sum(-1, keepdim=True)  # [T, H]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times = []
    for i in range(args.warmup + args.iters):
        client.begin_step(args.tokens)
        sync()
        start = time.perf_counter()
        y = client(0, x, ids, weights)
        sync()
        if i >= args.warmup:
            times.append((time.perf_counter() - start) * 1e6)
    err = ((y.float() - expected).abs().max() / expected.abs().max()).item()
    times.sort()
    return {"rank": world.rank, "median_us": statistics.median(times),
            "p10_us": times[len(times) // 10], "p90_us": times[-1 - len(times) // 10],
            "max_rel_err": err}


def _serve(backend: str, world: World, placement: Placement, args: argparse.Namespace,
           device: torch.device) -> None:
    """An expert rank: serve rounds until the parent stops this process."""
    from common.device import collective_backend
    from ep_dispatch.torch_dist import join, serve_experts
    from ep_dispatch.wire import RowFormat

    dtype = _dtype(args)
    rows = RowFormat(args.hidden, dtype, args.quantization)
    local = placement.local_experts(world.rank - world.num_attention)[0]  # layer 0
    expert_fn = _expert_fn(args.hidden, dtype, local)
    if backend == "deepep":
        from ep_dispatch.deepep import serve_deepep
        from ep_dispatch.deepep_config import DeepEPSettings

        join(world, args.timeout, "nccl", rows)
        serve_deepep(world, placement, expert_fn, args.hidden, args.top_k,
                     DeepEPSettings(max_tokens=args.tokens), device)
    elif backend == "nccl":
        from ep_dispatch.nccl import CupyNccl

        serve_experts(world, placement, expert_fn, rows, args.device,
                      CupyNccl(world, args.timeout, rows))
    else:
        join(world, args.timeout, collective_backend(args.device), rows)
        serve_experts(world, placement, expert_fn, rows, args.device)


def _rank(rank: int, backend: str, args: argparse.Namespace, port: int,
          results: mp.Queue, done: object) -> None:
    from ep_dispatch.placement import Placement
    from ep_dispatch.torch_dist import World

    try:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        if args.device == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        world = World(("127.0.0.1", port), args.attention_ranks, args.expert_ranks, rank)
        placement = Placement.balanced([0], args.experts, args.expert_ranks)
        with torch.inference_mode():
            if rank < args.attention_ranks:
                _attention(backend, world, placement, args, device, results, done)
            else:
                _serve(backend, world, placement, args, device)
    except BaseException:  # reported to the parent, which stops the others
        results.put({"rank": rank, "error": traceback.format_exc(limit=4)})


def run(backend: str, args: argparse.Namespace) -> dict:
    """One backend: every rank a process; the attention ranks' results, then all stopped."""
    port = free_port()
    ctx = mp.get_context("spawn")
    results, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_rank, args=(r, backend, args, port, results, done),
                         daemon=True)
             for r in range(args.attention_ranks + args.expert_ranks)]
    for p in procs:
        p.start()
    got: list[dict] = []
    deadline = time.monotonic() + args.timeout
    try:
        while len(got) < args.attention_ranks:
            got.append(results.get(timeout=max(1.0, deadline - time.monotonic())))
            if "error" in got[-1]:
                break
    except queue_module.Empty:
        got.append({"error": f"no result within {args.timeout:g} s"})
    finally:
        done.set()
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():  # stuck in a collective: SIGKILL
                p.kill()
                p.join(10)
    errors = [r["error"] for r in got if "error" in r]
    if errors:
        return {"backend": backend, "error": errors[0]}
    return {"backend": backend, "median_us": max(r["median_us"] for r in got),
            "p10_us": min(r["p10_us"] for r in got), "p90_us": max(r["p90_us"] for r in got),
            "max_rel_err": max(r["max_rel_err"] for r in got)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.attention_ranks + \
            args.expert_ranks:
        print(f"ep_latency: {args.attention_ranks + args.expert_ranks} ranks need as many "
              f"GPUs; this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    bound = 2e-2 if _dtype(args) == torch.bfloat16 else 1e-5
    deepep = DEEPEP_LL_US.get(args.expert_ranks)
    print(f"{args.attention_ranks} attention + {args.expert_ranks} expert ranks, "
          f"{args.device}, {args.tokens} tokens x {args.hidden} per attention rank, "
          f"top-{args.top_k} of {args.experts}, {_dtype(args)}"
          f"{', MXFP4 rows' if args.quantization else ''}, median of {args.iters}\n")
    print("| backend | dispatch+combine us: median (p10-p90) | max rel err | result | "
          "DeepEP LL, same EP size |\n|---|---:|---:|---|---|")
    rows, failed = [], False
    for backend in args.backends:
        r = run(backend, args)
        rows.append(r)
        if "error" in r:
            failed = True
            print(f"| {backend} | - | - | FAIL: {r['error'].strip().splitlines()[-1]} | |")
            continue
        ok = r["max_rel_err"] <= bound
        failed |= not ok
        ref = (f"{deepep[0]} + {deepep[1]} = {sum(deepep)} us: ours "
               f"{r['median_us'] / sum(deepep):.2f}x") if deepep else "none published"
        print(f"| {backend} | {r['median_us']:.0f} ({r['p10_us']:.0f}-{r['p90_us']:.0f}) | "
              f"{r['max_rel_err']:.1e} | {'ok' if ok else 'FAIL'} | {ref} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=1)
    sys.stdout.flush()
    os._exit(1 if failed else 0)  # spawned children are gone; skip their queues' joins


if __name__ == "__main__":
    sys.exit(main())
