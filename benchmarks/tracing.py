""".venv/bin/python -m benchmarks.tracing [--model DIR] [--rounds 3] [--concurrency 16]
                                       [--requests 48] [--input-len 64] [--output-len 64]

Tracing's overhead: serving throughput with tracing off, on at 1% sampling and on
at 100% sampling, in one run.

Three `switchyard serve` topologies (gateway, attention, 2 expert services, rpc) run side
by side on the same model; the "on" ones export over OTLP/HTTP to a sink process here that
decodes and counts the spans (so export is real, and the sampling visibly works). Rounds
alternate the configurations in rotating order, each a closed loop of `--requests`
streamed completions at `--concurrency` by `switchyard bench`'s client; the table gives
each configuration's median output tokens/s and its ratio to tracing off, the CPU
time the topology's processes spent per output token (steadier than throughput on a
small, shared machine), and spans received per request. Sampling is the standard
`parentbased_traceidratio` sampler.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from switchyard.bench import make_prompts, run_load, summarize
from switchyard.demo_model import DEFAULT_MODEL
from switchyard.serve_process import Served

CONFIGS = [("off", None), ("on, 1% sampled", "0.01"), ("on, 100% sampled", "1.0")]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sink(ready: mp.Queue) -> None:
    """An OTLP/HTTP endpoint that decodes each export and counts its spans by the first
    path segment (POST /NAME/v1/traces; GET /NAME reads the count)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    counts: dict[str, int] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = ExportTraceServiceRequest.FromString(body)
            name = self.path.split("/")[1]
            counts[name] = counts.get(name, 0) + sum(
                len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            self._reply(ExportTraceServiceResponse().SerializeToString(),
                        "application/x-protobuf")

        def do_GET(self) -> None:
            count = counts.get(self.path.split("/")[1], 0)
            self._reply(json.dumps(count).encode(), "application/json")

        def _reply(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ready.put(server.server_port)
    server.serve_forever()


def start_sink() -> tuple[mp.Process, str]:
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=_sink, args=(ready,), daemon=True)
    proc.start()
    return proc, f"http://127.0.0.1:{ready.get(timeout=60)}"


def cpu_seconds(served: Served) -> float:
    """User + system CPU time of the topology's service processes so far."""
    total = 0
    for pid in served.children:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def serve(model: Path, sink: str, ratio: str | None) -> Served:
    """A topology exporting to `sink` (a URL of its own on the sink), or not at all."""
    flags = ["--model", str(model), "--expert-services", "2"]
    env = {}
    if ratio is not None:
        flags += ["--otlp-traces-endpoint", f"{sink}/v1/traces"]
        env = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
               "OTEL_TRACES_SAMPLER_ARG": ratio}
    return Served(flags, env=env, timeout=600)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.requests, args.input_len, 0.0, vocab - 1, seed=0)
    sink_proc, sink = start_sink()
    served: list[Served] = []
    try:
        for name, ratio in CONFIGS:
            log(f"starting {name} ...")
            served.append(serve(args.model, f"{sink}/config{len(served)}", ratio))
        model = httpx.get(f"{served[0].url}/v1/models").json()["data"][0]["id"]
        for s in served:
            run_load(s.url, model, prompts[:4], 8, 4, None, 1, 0)  # warm-up
        rates: list[list[float]] = [[] for _ in CONFIGS]
        cpu_per_token: list[list[float]] = [[] for _ in CONFIGS]
        for r in range(args.rounds):
            for i in [(r + k) % len(CONFIGS) for k in range(len(CONFIGS))]:
                cpu = cpu_seconds(served[i])
                records, duration = run_load(served[i].url, model, prompts, args.output_len,
                                             args.concurrency, None, 4, 0)
                report = summarize(records, duration, args.concurrency, 4)
                assert report["failed"] == 0, report["errors"]
                rates[i].append(report["output_throughput"])
                tokens = report["output_throughput"] * report["duration_s"]
                cpu_per_token[i].append(1e3 * (cpu_seconds(served[i]) - cpu) / tokens)
                log(f"round {r + 1}: {CONFIGS[i][0]}: {rates[i][-1]:.1f} out tok/s")
        for s in served:
            s.stop()  # flushes what the batch span processors still hold
        spans = [httpx.get(f"{sink}/config{i}").json() for i in range(len(CONFIGS))]
    finally:
        for s in served:
            s.stop()
        sink_proc.kill()
    base = statistics.median(rates[0])
    requests = args.rounds * args.requests + 4  # each topology also served 4 warm-ups
    print(f"\n{args.rounds} rounds x {args.requests} requests, concurrency "
          f"{args.concurrency}, {args.input_len} in / {args.output_len} out, "
          f"model {args.model.name}\n")
    base_cpu = statistics.median(cpu_per_token[0])
    print("| tracing | out tok/s: median (each round) | vs off | vs off, same round: "
          "median (min-max) | service CPU ms per token: median | vs off | "
          "spans per request |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (name, _), rs, cs, n in zip(CONFIGS, rates, cpu_per_token, spans, strict=True):
        med = statistics.median(rs)
        paired = [x / off for x, off in zip(rs, rates[0], strict=True)]
        print(f"| {name} | {med:.1f} ({', '.join(f'{x:.0f}' for x in rs)}) | "
              f"{med / base:.3f} | {statistics.median(paired):.3f} ({min(paired):.2f}-"
              f"{max(paired):.2f}) | {statistics.median(cs):.2f} | "
              f"{statistics.median(cs) / base_cpu:.3f} | {n / requests:.1f} |")


if __name__ == "__main__":
    main()
