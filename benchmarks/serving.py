""".venv/bin/python -m benchmarks.serving [--concurrency 1 16 64] [--input-len 128]
    [--output-len 128] [--topologies local rpc local-w4a4 local-w4a4-int8]
    [--llama-server BINARY --gguf FILE] [--json FILE] [--rounds R [--requests N]]

Switchyard served vs. transformers `generate()` (and llama.cpp's server), and every
configuration's decode step against this machine's memory-bandwidth floor, in one run.

One run measures the machine (read and copy bandwidth, float32 matmul), then on the
mid-size random checkpoint of benchmarks/generate.py, with the same fixed-seed prompts:

1. transformers `generate()` with the `c` prompts as one batch (greedy, exactly
   `--output-len` new tokens), end-to-end output tokens/s;
2. the engine in-process: median decode step at batch `c` and the bytes that step must
   read (experts actually hit, dense weights, KV), hence the floor;
3. `switchyard serve` single-process and distributed (rpc, 2 expert services), loaded by
   `switchyard bench`'s client at concurrency `c` through HTTP streaming; the served
   TPOT against the in-process step, and against the server's own mean decode step over
   the same load (`switchyard:engine_step_seconds`, which includes a topology's exchanges
   with its expert services): the serving overhead.

4. with `--llama-server`, llama.cpp's server on `--gguf` (the same checkpoint converted,
   e.g. Q4_0), started once per level with as many slots as requests at once and 2
   threads, under the same client and prompts.

With `--rounds`, instead: concurrency 1 only, every server up at once and loaded in turn,
round after round (`side_by_side`): the per-token time's ratios, robust to the drift of a
shared machine.

The model's dtype is float32 (torch's bf16 matmul is ~100x slower on CPUs without AVX-512
BF16); `--topologies` adds W4A4 experts and int8 dense linears.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.floor import StepParts, decode_steps, machine
from benchmarks.generate import add_workdir_flag, bench_transformers, build_checkpoint
from common.ports import free_port
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from switchyard.bench import format_table, make_prompts, run_load, summarize
from switchyard.serve_process import Served
from tests.support.tools import wait_until

TOPOLOGIES = {  # name: (what the tables call it, serve's flags)
    "local": ("switchyard, 1 process", ["--dispatch-backend", "local"]),
    "rpc": ("switchyard, attention + 2 expert services (rpc)",
            ["--dispatch-backend", "rpc", "--expert-services", "2"]),
    "local-w4a4": ("switchyard, 1 process, W4A4",
                   ["--dispatch-backend", "local", "--quantization", "w4a4"]),
    "local-w4a4-int8": ("switchyard, 1 process, W4A4 + int8 dense",
                        ["--dispatch-backend", "local", "--quantization", "w4a4",
                         "--dense-quantization", "int8"]),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def transformers_rows(path: Path, prompts: list[list[int]], levels: list[int],
                      output_len: int) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    log("transformers: loading ...")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bench_transformers(hf, prompts[:1], 2)  # warm-up
    out = {}
    for c in levels:
        log(f"transformers: batch {c} ...")
        out[c] = bench_transformers(hf, prompts[:c], output_len)
    return out


def floor_rows(path: Path, levels: list[int], input_len: int, read_gbs: float
               ) -> dict[int, dict[str, float]]:
    log("engine in-process: decode steps vs. floor ...")
    engine = build_engine(AttentionConfig(model=path, dtype="float32", kv_cache_memory=1 << 30,
                                    max_num_batched_tokens=2048))
    out = {}
    parts = StepParts(engine)
    for c in levels:
        steps = decode_steps(engine, parts, c, input_len, steps=10)
        step_s = statistics.median(t for t, *_ in steps)
        nbytes = statistics.median(b for _, b, *_ in steps)
        out[c] = {"step_ms": 1e3 * step_s, "mb_read": nbytes / 1e6,
                  "floor_ms": 1e3 * nbytes / (read_gbs * 1e9)}
    engine.close()
    return out


def decode_steps_served(url: str) -> tuple[float, float]:
    """(seconds, count) of the served engines' decode steps so far, from the gateway's
    merged /metrics (`switchyard:engine_step_seconds`)."""
    seconds = count = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name == "switchyard:engine_step_seconds":
            for sample in family.samples:
                if sample.labels.get("kind") == "decode":
                    if sample.name.endswith("_sum"):
                        seconds += sample.value
                    elif sample.name.endswith("_count"):
                        count += sample.value
    return seconds, count


def busy_seconds(url: str) -> dict[str, float]:
    """Seconds each kind of service (attention, expert) has computed so far, summed over
    its processes, from the gateway's merged /metrics (`switchyard:busy_seconds_total`)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name == "switchyard:busy_seconds":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    kind = sample.labels.get("service", "")
                    out[kind] = out.get(kind, 0.0) + sample.value
    return out


def served_rows(path: Path, flags: list[str], prompts: list[list[int]], levels: list[int],
                output_len: int) -> dict[int, dict]:
    """Each level's `summarize` figures, `step_ms`: the server's own mean decode step
    over the level (its exchanges with expert services included), and `busy_s`: each
    kind of service's computing seconds over the level (`busy_seconds`)."""
    with Served(["--model", str(path), "--kv-cache-memory", "1GiB", *flags],
                timeout=900) as served:
        return measured_rows(served.url, prompts, levels, output_len)


def healthy(url: str) -> bool:
    """Whether the server at `url` answers /health with 200."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    return False


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, slots: int, context: int) -> Iterator[str]:
    """llama.cpp's server on `gguf` with `slots` slots sharing `context` tokens and 2
    threads, on loopback: its base URL once healthy."""
    port = free_port()
    with subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port",
                           str(port), "-t", "2", "-np", str(slots), "-c", str(context)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        try:
            url = f"http://127.0.0.1:{port}"
            wait_until(lambda: healthy(url) or proc.poll() is not None, 300,
                       lambda: "llama.cpp's server healthy")
            if proc.poll() is not None:
                raise RuntimeError(f"llama.cpp's server exited ({binary})")
            yield url
        finally:
            proc.kill()


def llama_rows(binary: Path, gguf: Path, prompts: list[list[int]], levels: list[int],
               output_len: int) -> dict[int, dict]:
    """llama.cpp's server per level: started with that many slots (each with the context
    one request needs), loaded as `measured_rows` loads ours."""
    out = {}
    for c in levels:
        log(f"llama.cpp: {c} slots ...")
        with llama_server(binary, gguf, c, c * (len(prompts[0]) + output_len + 64)) as url:
            out |= measured_rows(url, prompts, [c], output_len, ours=False)
    return out


def side_by_side(args: argparse.Namespace, path: Path, prompts: list[list[int]]) -> None:
    """Concurrency 1, every server up at once and loaded in turn, `--requests` requests
    each per round for `--rounds` rounds: each round's median time per output token
    ((E2E - TTFT) / (tokens - 1), as `switchyard bench`'s TPOT) and its ratio to the
    first server's, so the machine's drift falls on every server alike."""
    with contextlib.ExitStack() as stack:
        urls = {TOPOLOGIES[k][0]: stack.enter_context(Served(
            ["--model", str(path), "--kv-cache-memory", "1GiB", *TOPOLOGIES[k][1]],
            timeout=900)).url for k in args.topologies}
        if args.llama_server:
            urls[f"llama.cpp server, {args.gguf.name}"] = stack.enter_context(llama_server(
                args.llama_server, args.gguf, 1, len(prompts[0]) + args.output_len + 64))
        models = {name: httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
                  for name, url in urls.items()}
        rows: dict[str, list[float]] = {name: [] for name in urls}
        for r in range(args.rounds):
            for name, url in urls.items():
                log(f"round {r + 1}/{args.rounds}: {name} ...")
                records, duration = run_load(url, models[name], prompts[:args.requests],
                                             args.output_len, 1, None, 1, 0)
                report = summarize(records, duration, 1, 1)
                rows[name].append(report["tpot"]["median_ms"])  # type: ignore[index]
                if report["failed"] or report["retried"]:
                    log(f"  {report['failed']} failed: {report['failures']}; "
                        f"{report['retried']} sent again")
    first = next(iter(rows))
    print(f"concurrency 1, {args.requests} requests of {len(prompts[0])} + "
          f"{args.output_len} tokens per server per round, {args.rounds} rounds\n")
    print("| server | TPOT median ms, per round | median | vs " + first + " |")
    print("|---|---|---:|---:|")
    for name, tpots in rows.items():
        ratios = [t / f for t, f in zip(tpots, rows[first], strict=True)]
        print(f"| {name} | {', '.join(f'{t:.2f}' for t in tpots)} | "
              f"{statistics.median(tpots):.2f} | {statistics.median(ratios):.2f}x |")


def measured_rows(url: str, prompts: list[list[int]], levels: list[int], output_len: int,
                  ours: bool = True) -> dict[int, dict]:
    """`served_rows`' figures of the server at `url` (not ours: without its own step and
    busy figures, which come from Switchyard's /metrics)."""
    out = {}
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    run_load(url, model, prompts[:2], 4, 2, None, 1, 0)  # warm-up
    for c in levels:
        n = max(c, 4)
        log(f"  concurrency {c}: {n} requests ...")
        before = (decode_steps_served(url), busy_seconds(url)) if ours else None
        records, duration = run_load(url, model, prompts[:n], output_len, c, None,
                                     min(4, c), 0)
        out[c] = summarize(records, duration, c, min(4, c))
        if before is None:
            continue
        (seconds, count), busy = before
        after = decode_steps_served(url)
        out[c]["step_ms"] = 1e3 * (after[0] - seconds) / max(after[1] - count, 1)
        out[c]["busy_s"] = {kind: s - busy.get(kind, 0.0)
                            for kind, s in busy_seconds(url).items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workdir_flag(ap)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", type=Path, help="also write every figure as JSON here")
    ap.add_argument("--skip-transformers", action="store_true",
                    help="leave out transformers' generate() (the serving overhead only)")
    ap.add_argument("--topologies", nargs="+", choices=list(TOPOLOGIES),
                    default=["local", "rpc"], help="which Switchyard configurations to serve")
    ap.add_argument("--llama-server", type=Path,
                    help="also llama.cpp's server (this binary) on --gguf")
    ap.add_argument("--gguf", type=Path, help="the checkpoint for --llama-server, converted")
    ap.add_argument("--rounds", type=int,
                    help="instead of the tables: concurrency 1 side by side, every server "
                         "up at once and loaded in turn for this many rounds")
    ap.add_argument("--requests", type=int, default=16,
                    help="with --rounds: requests per server per round")
    args = ap.parse_args()
    path = build_checkpoint(args.workdir)
    levels = args.concurrency
    prompts = make_prompts(max(max(levels), 4, args.requests), args.input_len, 0.0, 200,
                           seed=0)
    if args.rounds:
        side_by_side(args, path, prompts)
        return

    log("measuring the machine ...")
    m = machine()
    hf = {} if args.skip_transformers else transformers_rows(path, prompts, levels,
                                                             args.output_len)
    gc.collect()
    floor = floor_rows(path, levels, args.input_len, m["read_gbs"])
    gc.collect()
    served = {}
    for key in args.topologies:
        name, flags = TOPOLOGIES[key]
        log(f"{name}: starting ...")
        served[name] = served_rows(path, flags, prompts, levels, args.output_len)
    if args.llama_server:
        served[f"llama.cpp server, {args.gguf.name}"] = llama_rows(
            args.llama_server, args.gguf, prompts, levels, args.output_len)

    print(f"machine: read {m['read_gbs']:.1f} GB/s, copy {m['copy_gbs']:.1f} GB/s "
          f"(read + write), float32 matmul {m['matmul_gflops']:.0f} GFLOP/s; "
          f"{args.input_len} input + {args.output_len} output tokens, float32\n")
    print("| concurrency | transformers out tok/s | "
          + " | ".join(f"{name} out tok/s" for name in served) + " | best / transformers |")
    print("|---:|---:|" + "---:|" * len(served) + "---:|")
    for c in levels:
        tps = [served[name][c]["output_throughput"] for name in served]
        ratio = f"{max(tps) / hf[c]:.2f}x" if c in hf else "-"
        print(f"| {c} | {hf[c]:.1f} | " if c in hf else f"| {c} | - | ", end="")
        print(" | ".join(f"{t:.1f}" for t in tps) + f" | {ratio} |")
    print("\n| concurrency | MB read per decode step | floor ms | engine step ms (x floor) | "
          + " | ".join(f"{name} TPOT median ms (x floor; x step)" for name in served) + " | "
          + " | ".join(f"{name}: its own decode step ms (TPOT / it)" for name in served)
          + " |")
    print("|---:|---:|---:|---:|" + "---:|" * 2 * len(served))
    for c in levels:
        f = floor[c]
        tpots = [s[c]["tpot"]["median_ms"] for s in served.values()]
        cells = [f"{t:.1f} ({t / f['floor_ms']:.2f}x; {t / f['step_ms']:.2f}x step)"
                 for t in tpots]
        cells += [f"{s[c]['step_ms']:.1f} ({t / s[c]['step_ms']:.2f}x)" if "step_ms" in s[c]
                  else "-" for t, s in zip(tpots, served.values(), strict=True)]
        print(f"| {c} | {f['mb_read']:.0f} | {f['floor_ms']:.1f} | "
              f"{f['step_ms']:.1f} ({f['step_ms'] / f['floor_ms']:.2f}x) | " + " | ".join(cells)
              + " |")
    for name, rows in served.items():
        print(f"\n{name}, through HTTP (switchyard bench client):\n")
        print(format_table([rows[c] for c in levels]))
    if args.json:
        args.json.write_text(json.dumps({"machine": m, "transformers": hf, "floor": floor,
                                         "served": served}, indent=2))


if __name__ == "__main__":
    main()
