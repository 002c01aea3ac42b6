"""Issue 31's placement figures: each workload served over 4 expert services with the
round-robin placement, then with the placement DeepSeek's EPLB makes from the routing
load that run measured (`switchyard placement --load URL --num-redundant-experts R`), the
same load again.

    .venv/bin/python -m benchmarks.eplb [--workloads demo skewed] [--concurrency 16]
                                        [--requests 64] [--redundant 4]

Workloads: `demo`, the bundled demo model on its own task's questions (its trained
routing); `skewed`, the DeepSeek-V3-shaped mid checkpoint of benchmarks/generate.py with
a router bias (`e_score_correction_bias` + 0.5) on experts 0, 4, 8 and 12 of every layer,
so that every token picks them: round-robin puts all four on expert rank 0. Each row
gives, over the load alone (the counters' increase): balancedness (mean over max of the
ranks' rows, per layer, the layers summed: vLLM's), the busiest rank's share of the
experts' compute seconds (1/4 is even), and output tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from benchmarks.generate import add_workdir_flag, build_checkpoint
from gateway.expert_stats import balance, rank_tokens
from switchyard.bench import make_prompts, run_load, summarize
from switchyard.cli import main as cli
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


def counters(url: str) -> tuple[dict[tuple[int, int], float], dict[int, float]]:
    """(layer, rank) -> rows, and rank -> expert compute seconds, from /metrics."""
    families = list(text_string_to_metric_families(httpx.get(f"{url}/metrics").text))
    seconds: dict[int, float] = {}
    for family in families:
        if family.name == "switchyard:expert_compute_seconds":
            for s in family.samples:
                if s.name.endswith("_sum"):
                    rank = int(s.labels["rank"])
                    seconds[rank] = seconds.get(rank, 0.0) + s.value
    return dict(rank_tokens(families)), seconds


def measure(path: Path, flags: list[str], prompts: list[list[int]], output_len: int,
            concurrency: int, redundant: int) -> tuple[dict, str]:
    """Serve, warm up, run the load; its figures and the EPLB placement of its load."""
    with Served(["--model", str(path), "--kv-cache-memory", "1GiB",
                 "--expert-services", str(EXPERT_SERVICES), *flags], timeout=900) as served:
        model = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        run_load(served.url, model, prompts[:4], 4, 4, None, 1, 0)  # warm-up
        rows0, secs0 = counters(served.url)
        records, duration = run_load(served.url, model, prompts, output_len, concurrency,
                                     None, min(4, concurrency), 0)
        rows1, secs1 = counters(served.url)
        rows = {k: v - rows0.get(k, 0.0) for k, v in rows1.items()}
        secs = {r: s - secs0.get(r, 0.0) for r, s in secs1.items()}
        summary = summarize(records, duration, concurrency, min(4, concurrency))
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert cli(["placement", "--model", str(path), "--expert-services",
                        str(EXPERT_SERVICES), "--load", served.url,
                        "--num-redundant-experts", str(redundant), "--json"]) == 0
    load = balance(rows)
    figures = {"balancedness": load["balancedness"],
               "ranks": {r["rank"]: r["tokens"] for r in load["ranks"]},
               "busiest_share": max(secs.values()) / sum(secs.values()),
               "seconds": secs, "tok_s": summary["output_throughput"],
               "failed": summary["failed"]}
    return figures, printed.getvalue()


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
    args = ap.parse_args()
    table = []
    for workload in args.workloads:
        if workload == "demo":
            path, prompts, output_len = Path(DEFAULT_MODEL), demo_prompts(args.requests), 8
        else:
            path = skewed_checkpoint(args.workdir)
            prompts, output_len = make_prompts(args.requests, 128, 0.0, 200, seed=0), 32
        log(f"{workload}: round-robin placement ...")
        before, placement = measure(path, [], prompts, output_len, args.concurrency,
                                    args.redundant)
        file = args.workdir / f"eplb-{workload}.json"
        file.write_text(placement)
        log(f"{workload}: EPLB's placement ({file}) ...")
        after, _ = measure(path, ["--placement", str(file)], prompts, output_len,
                           args.concurrency, args.redundant)
        table.append((workload, before, after))
    print(f"\n{EXPERT_SERVICES} expert services (rpc), concurrency {args.concurrency}, "
          f"{args.requests} requests; EPLB with {args.redundant} redundant experts a layer\n")
    print("| workload | placement | balancedness | rows per rank | busiest rank's share of "
          "expert seconds | out tok/s | failed |")
    print("|---|---|---:|---|---:|---:|---:|")
    for workload, before, after in table:
        for name, f in (("round-robin", before), ("EPLB", after)):
            ranks = ", ".join(f"{int(v)}" for _, v in sorted(f["ranks"].items()))
            print(f"| {workload} | {name} | {f['balancedness']:.2f} | {ranks} | "
                  f"{100 * f['busiest_share']:.0f}% | {f['tok_s']:.1f} | {f['failed']} |")
    print(json.dumps({w: {"round-robin": b, "EPLB": a} for w, b, a in table}, default=str),
          file=sys.stderr)


if __name__ == "__main__":
    main()
