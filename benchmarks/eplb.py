""".venv/bin/python -m benchmarks.eplb [--workloads demo skewed] [--concurrency 16]
                                    [--requests 64] [--redundant 4] [--churn-every 3]

EPLB against round-robin: each workload served over 4 expert services, all in one server
and one run. First with the round-robin placement; then the gateway rebalances while
serving (`POST /eplb/rebalance`: DeepSeek's EPLB of the routing load it counted, with R
redundant experts a layer) and the same load runs again; then the load runs once more
while an operator moves the experts every few seconds, between EPLB's placement and the
same with every copy one rank on (as balanced, and every copy moves). Prefix caching is
off: the phases' prompts are the same, and each phase computes them.

Workloads: `demo`, the bundled demo model on its own task's questions (its trained
routing); `skewed`, the DeepSeek-V3-shaped mid checkpoint of benchmarks/generate.py with
a router bias (`e_score_correction_bias` + 0.5) on experts 0, 4, 8 and 12 of every layer,
so that every token picks them: round-robin puts all four on expert rank 0. Each row
gives, over its load alone (the counters' increase): balancedness (mean over max of the
ranks' rows, per layer, the layers summed: vLLM's), the busiest rank's share of the
experts' compute seconds (1/4 is even), output tokens/s, failed requests, and the
inter-token latency's p99 and maximum, and the bucket of the slowest decode step (a step
that waited shows in these); the second table gives each rebalance's duration (every
expert rank's load, and every group's switch between two steps).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import sys
import threading
from functools import partial
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from benchmarks.generate import add_workdir_flag, build_checkpoint
from ep_dispatch.placement import Placement
from gateway.observability.metrics import balance, rank_tokens
from services.model.config import ModelConfig
from switchyard.bench import make_prompts, run_load, summarize
from switchyard.demo_model import DEFAULT_MODEL
from switchyard.demo_task import problems
from switchyard.serve_process import Served

EXPERT_SERVICES = 4
HOT = (0, 4, 8, 12)  # all on rank 0 under round-robin (expert % 4)


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def skewed_checkpoint(workdir: Path) -> Path:
    """The DeepSeek-V3-shaped mid checkpoint with experts HOT biased to be chosen."""
    path = workdir / "deepseek-v3-mid-skewed"
    if (path / "config.json").is_file():
        return path
    source = build_checkpoint(workdir, "deepseek-v3-mid")
    log(f"writing the skewed copy in {path} ...")
    path.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy2(file, path / file.name)
            continue
        tensors = load_file(file)
        for name, t in tensors.items():
            if name.endswith("e_score_correction_bias"):
                t[list(HOT)] += 0.5
        save_file(tensors, path / file.name, metadata={"format": "pt"})
    return path


def demo_prompts(n: int) -> list[list[int]]:
    """The demo task's held-out questions, chat-templated and tokenized as the gateway
    does."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(DEFAULT_MODEL) / "tokenizer.json"))
    return [tokenizer.encode(f"<|user|>{p.question}<|assistant|>",
                             add_special_tokens=False).ids for p in problems(7, n)]


def counters(url: str) -> tuple[dict[tuple[int, int], float], dict[int, float],
                                dict[float, float]]:
    """(layer, rank) -> rows, rank -> expert compute seconds, and the decode steps'
    cumulative histogram (upper bound -> steps), from /metrics."""
    families = list(text_string_to_metric_families(httpx.get(f"{url}/metrics").text))
    seconds: dict[int, float] = {}
    steps: dict[float, float] = {}
    for family in families:
        for s in family.samples:
            if family.name == "switchyard:expert_compute_seconds" and s.name.endswith("_sum"):
                rank = int(s.labels["rank"])
                seconds[rank] = seconds.get(rank, 0.0) + s.value
            elif s.name == "switchyard:engine_step_seconds_bucket" and \
                    s.labels["kind"] == "decode":
                bound = float(s.labels["le"])
                steps[bound] = steps.get(bound, 0.0) + s.value
    return dict(rank_tokens(families)), seconds, steps


def slowest_step(before: dict[float, float], after: dict[float, float]) -> float:
    """The upper bound of the histogram bucket that holds the slowest decode step taken
    between the two readings: the least bound that every new step is under."""
    new = {b: after[b] - before.get(b, 0.0) for b in after}  # cumulative, per bound
    return min(b for b in sorted(new) if new[b] == new[math.inf])


class Phase:
    """The counters' increase over one load, and what the clients saw."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.rows0, self.secs0, self.steps0 = counters(url)

    def end(self, records: list, duration: float, concurrency: int) -> dict:
        rows1, secs1, steps1 = counters(self.url)
        rows = {k: v - self.rows0.get(k, 0.0) for k, v in rows1.items()}
        secs = {r: s - self.secs0.get(r, 0.0) for r, s in secs1.items()}
        summary = summarize(records, duration, concurrency, min(4, concurrency))
        itls = [x for r in records if r.ok for x in r.itls]
        load = balance(rows)
        return {"balancedness": load["balancedness"],
                "ranks": {r["rank"]: r["tokens"] for r in load["ranks"]},
                "busiest_share": max(secs.values()) / sum(secs.values()),
                "seconds": secs, "tok_s": summary["output_throughput"],
                "failed": summary["failed"], "itl_p99_ms": summary["itl"]["p99_ms"],
                "itl_max_ms": 1e3 * max(itls, default=0.0),
                "slowest_step_s": slowest_step(self.steps0, steps1)}


def rotated(placement: Placement) -> Placement:
    """The placement with every copy one rank on: as balanced, and every copy moves."""
    n = placement.num_ranks
    return Placement(n, placement.num_experts, {
        layer: tuple(tuple((r + 1) % n for r in ranks) for ranks in experts)
        for layer, experts in placement.replicas.items()})


def rebalance(url: str, placement: str | None = None) -> dict:
    body = {"placement": json.loads(placement)} if placement else None
    r = httpx.post(f"{url}/eplb/rebalance", json=body, timeout=900)
    r.raise_for_status()
    record = r.json()["rebalance"]
    if record is None or record["error"]:
        raise RuntimeError(f"the rebalance did not move: {record}")
    return record


def measure(path: Path, prompts: list[list[int]], output_len: int, concurrency: int,
            redundant: int, churn_every: float) -> dict[str, dict]:
    """One server: round-robin, a rebalance by load, the same load; then under churn."""
    flags = ["--model", str(path), "--kv-cache-memory", "1GiB", "--no-enable-prefix-caching",
             "--expert-services",
             str(EXPERT_SERVICES), "--enable-eplb", "--eplb-interval", "0",
             "--eplb-window", "1000000", "--num-redundant-experts", str(redundant)]
    with Served(flags, timeout=900) as served:
        url = served.url
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        run_load(url, model, prompts[:4], 4, 4, None, 1, 0)  # warm-up
        load = partial(run_load, url, model, prompts, output_len, concurrency, None,
                       min(4, concurrency), 0)
        phase = Phase(url)
        before = phase.end(*load(), concurrency)
        log("rebalancing by the measured load ...")
        first = rebalance(url)
        phase = Phase(url)
        after = phase.end(*load(), concurrency)
        cfg = ModelConfig.from_dir(path)
        eplb = Placement.from_json(json.dumps(httpx.get(f"{url}/eplb").json()["placement"]),
                                   cfg.moe_layer_ids, cfg.num_experts)
        placements = [eplb.to_json(), rotated(eplb).to_json()]
        log(f"the same load, the experts moved every {churn_every:g} s ...")
        stop, moves = threading.Event(), []

        def operator() -> None:
            for placement in itertools.cycle(placements[::-1]):  # rotated first
                if stop.wait(churn_every):
                    return
                moves.append(rebalance(url, placement))

        thread = threading.Thread(target=operator, daemon=True)
        phase = Phase(url)
        thread.start()
        try:
            churn = phase.end(*load(), concurrency)
        finally:
            stop.set()
            thread.join(900)
        churn["rebalances"] = moves
    return {"round-robin": before, "EPLB (live)": after, "churn": churn,
            "first_rebalance": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workdir_flag(ap)
    ap.add_argument("--workloads", nargs="+", choices=["demo", "skewed"],
                    default=["demo", "skewed"])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--redundant", type=int, default=4,
                    help="EPLB's redundant experts per layer (a multiple of 4 here)")
    ap.add_argument("--churn-every", type=float, default=3.0,
                    help="seconds between the operator's moves in the churn phase")
    args = ap.parse_args()
    results = {}
    for workload in args.workloads:
        if workload == "demo":
            path, prompts, output_len = Path(DEFAULT_MODEL), demo_prompts(args.requests), 8
        else:
            path = skewed_checkpoint(args.workdir)
            prompts, output_len = make_prompts(args.requests, 128, 0.0, 200, seed=0), 32
        log(f"{workload}: round-robin placement ...")
        results[workload] = measure(path, prompts, output_len, args.concurrency,
                                    args.redundant, args.churn_every)
    print(f"\n{EXPERT_SERVICES} expert services (rpc), concurrency {args.concurrency}, "
          f"{args.requests} requests a phase; EPLB with {args.redundant} redundant experts "
          f"a layer, moved while serving\n")
    print("| workload | phase | balancedness | rows per rank | busiest rank's share of "
          "expert seconds | out tok/s | failed | ITL p99 / max ms | slowest decode step |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for workload, phases in results.items():
        for name in ("round-robin", "EPLB (live)", "churn"):
            f = phases[name]
            ranks = ", ".join(f"{int(v)}" for _, v in sorted(f["ranks"].items()))
            print(f"| {workload} | {name} | {f['balancedness']:.2f} | {ranks} | "
                  f"{100 * f['busiest_share']:.0f}% | {f['tok_s']:.1f} | {f['failed']} | "
                  f"{f['itl_p99_ms']:.0f} / {f['itl_max_ms']:.0f} | "
                  f"≤ {f['slowest_step_s']:g} s |")
    print("\n| workload | rebalance | copies moved | expert ranks' load s | switch ms | "
          "total s |")
    print("|---|---|---:|---:|---:|---:|")
    for workload, phases in results.items():
        for name, r in [("by load", phases["first_rebalance"]),
                        *((f"churn {i + 1}", r) for i, r in
                          enumerate(phases["churn"]["rebalances"]))]:
            print(f"| {workload} | {name} | {r['moved']} | {r['load_s']:.2f} | "
                  f"{1e3 * r['switch_s']:.1f} | {r['duration_s']:.2f} |")
    print(json.dumps(results, default=str), file=sys.stderr)


if __name__ == "__main__":
    main()
