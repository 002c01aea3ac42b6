"""What the dashboard costs the gateway.

    .venv/bin/python -m benchmarks.dashboard [--phase-seconds 30] [--rounds 2]
        [--layers 58 --experts 256 --ranks 8 --ticks 180]

1. Served: `switchyard serve` (the demo model, 2 expert services) after some load, its
   gateway's CPU time per second of wall time (from /proc) with no page open and with a
   page polling `/dashboard/data` once a second (the page's default window, as the page
   asks), in alternating phases. The difference is the page's cost; the first figure
   holds the recorder's own readings (every --dashboard-interval, 5 s by default).
2. At scale, in process: one recorder tick (parsing every expert rank's exposition and
   adding it to the window) and one `/dashboard/data` answer for a model of --layers MoE
   layers x --experts experts over --ranks expert ranks, with --ticks readings kept (15
   minutes at 5 s), every expert busy at every tick; and the memory those readings hold.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

from gateway.observability.dashboard.page import Views
from gateway.observability.dashboard.recorder import MAX_SHARE, Recorder, Settings
from gateway.observability.request_log import RequestLog
from gateway.observability.service_metrics import Scrape, parse
from services.model.expert_metrics import EXPERT_BUCKETS
from switchyard.serve_process import Served

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def resident_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def served(phase_s: float, rounds: int) -> None:
    with Served(["--expert-services", "2"]) as server, httpx.Client(timeout=30) as client:
        name = client.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        for i in range(32):
            client.post(f"{server.url}/v1/completions", json={
                "model": name, "prompt": f"{i} + {i} =", "max_tokens": 16, "ignore_eos": True})
        gateway = server.services()["gateway"]
        share: dict[str, list[float]] = {"no page": [], "page at 1 s": []}
        for r in range(rounds):
            for phase, polling in (("no page", False), ("page at 1 s", True)):
                start_cpu, start = cpu_seconds(gateway), time.monotonic()
                polls = 0
                while (now := time.monotonic()) < start + phase_s:
                    if polling:
                        assert client.get(f"{server.url}/dashboard/data").status_code == 200
                        polls += 1
                    time.sleep(max(0.0, start + polls - time.monotonic()) if polling else
                               start + phase_s - now)
                used = cpu_seconds(gateway) - start_cpu
                share[phase].append(used / (time.monotonic() - start))
                print(f"round {r + 1} {phase}: {100 * share[phase][-1]:.2f}% of a core"
                      + (f" ({polls} polls)" if polling else ""), flush=True)
    base, page = (statistics.median(share[p]) for p in share)
    print(f"\n| gateway | CPU, % of one core |\n|---|---:|\n| no page | {100 * base:.2f} |\n"
          f"| page polling /dashboard/data every 1 s | {100 * page:.2f} |\n"
          f"| the page's cost | **{100 * (page - base):.2f}** |")


def exposition(rank: int, layers: int, experts: int, ranks: int, tick: int) -> str:
    """One expert rank's /metrics text (its share of the experts) after `tick` ticks."""
    rng = random.Random(rank * 7919 + tick)
    out = ["# TYPE switchyard:expert_compute_seconds histogram"]
    tokens = ["# TYPE switchyard:expert_tokens_total counter"]
    for layer in range(layers):
        for expert in range(rank, experts, ranks):
            labels = f'layer="{layer}",expert="{expert}",rank="{rank}"'
            calls = tick * 4 + rng.randrange(4)
            running = 0
            for bound in EXPERT_BUCKETS:
                running = min(calls, running + rng.randrange(3))
                out.append(f"switchyard:expert_compute_seconds_bucket{{{labels},le=\"{bound}\"}}"
                           f" {running}")
            out.append(f'switchyard:expert_compute_seconds_bucket{{{labels},le="+Inf"}} {calls}')
            out.append(f"switchyard:expert_compute_seconds_sum{{{labels}}} {calls * 1e-4}")
            out.append(f"switchyard:expert_compute_seconds_count{{{labels}}} {calls}")
            tokens.append(f"switchyard:expert_tokens_total{{{labels}}} {calls * 3}")
    return "\n".join(out + tokens) + "\n"


def at_scale(layers: int, experts: int, ranks: int, ticks: int) -> None:
    info = SimpleNamespace(moe_layers=list(range(layers)), num_experts=experts)
    sources = SimpleNamespace(engine=SimpleNamespace(info=info), requests=RequestLog(),
                              rebalancer=SimpleNamespace(history=[], placement=None,
                                                         config=SimpleNamespace(enabled=False)))
    recorder = Recorder(Settings("m", "http://127.0.0.1:0"), sources)  # type: ignore[arg-type]
    gc.collect()
    before = resident_mb()
    parse_s, absorb_s = [], []
    every_s = 900.0 / ticks  # the readings span the history
    for tick in range(ticks + 1):
        texts = [exposition(r, layers, experts, ranks, tick) for r in range(ranks)]
        t0 = time.perf_counter()
        scrapes = [Scrape(f"rank{r}", parse(text)) for r, text in enumerate(texts)]
        t1 = time.perf_counter()
        recorder.window.absorb(scrapes, float(tick * every_s))
        absorb_s.append(time.perf_counter() - t1)
        parse_s.append(t1 - t0)
        if tick % 20 == 0:
            print(f"tick {tick}/{ticks}: parse {parse_s[-1]:.2f} s, absorb {absorb_s[-1]:.2f} s",
                  flush=True)
    del texts, scrapes
    gc.collect()
    kept_mb = resident_mb() - before
    views = Views(recorder)
    answer_s = []
    for window in (60.0, 300.0, 900.0, None):
        t0 = time.perf_counter()
        views.overview(window)
        answer_s.append(time.perf_counter() - t0)
    copies_mb = sum(values.nbytes for _, copy in recorder.window._kept
                    for values in copy._arrays.values()) / 2**20
    reading = statistics.median(parse_s) + statistics.median(absorb_s)
    every = max(5.0, MAX_SHARE * reading)  # the recorder's pace (`Recorder.run`)
    answer = statistics.median(answer_s)
    print(f"\n{layers} layers x {experts} experts over {ranks} ranks, {ticks} readings, "
          f"{len(recorder.window._kept)} copies kept:\n"
          f"| part | figure |\n|---|---:|\n"
          f"| a reading: parse every rank's /metrics | {statistics.median(parse_s):.2f} s |\n"
          f"| a reading: add it to the window | {statistics.median(absorb_s):.2f} s |\n"
          f"| the recorder reads every | {every:.1f} s |\n"
          f"| the recorder's share of a core | {100 * reading / every:.1f}% |\n"
          f"| a /dashboard/data answer (median of 1, 5, 15 min, all) | {1e3 * answer:.0f} ms |\n"
          f"| a page at 1 s: one answer a reading | {100 * answer / every:.1f}% of a core |\n"
          f"| the copies' arrays | {copies_mb:.0f} MB |\n"
          f"| the process's resident memory grew by | {kept_mb:.0f} MB |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase-seconds", type=float, default=30.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--ticks", type=int, default=180)
    p.add_argument("--skip-served", action="store_true")
    args = p.parse_args()
    if not args.skip_served:
        served(args.phase_seconds, args.rounds)
    at_scale(args.layers, args.experts, args.ranks, args.ticks)


if __name__ == "__main__":
    main()
