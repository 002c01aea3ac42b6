""".venv/bin/python -m benchmarks.chaos [--duration 600] [--kill-every 30] [--clients 8]
                                     [--check] [-- SERVE FLAGS]

The chaos soak: `switchyard serve` of the demo model under a steady load of
clients asking its task's questions back to back, while every `--kill-every` seconds a
random service (an attention group, a DCP peer with `-- --dcp-size 2`, or an expert
service; never the gateway) is killed with SIGKILL and `serve` starts it again (with its
unit: a DCP group's ranks together).

It reports requests ok and failed, the answers' accuracy (the demo model's own, measured
by `switchyard eval`, is the reference), each service's resident memory over the soak,
the KV blocks still in use once the load has stopped, and each kill's recovery time
(until /health answers 200 again). `--check` exits 1 unless no request failed, no KV
block stayed in use, and every kill recovered: what `.ci/run` runs for 2 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from switchyard.demo_task import draw, held_out, is_correct
from switchyard.serve_process import Served

RSS_EVERY_S = 5.0


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass
class Soak:
    ok: int = 0
    failed: int = 0
    correct: int = 0
    errors: list[str] = field(default_factory=list)
    kills: list[dict] = field(default_factory=list)  # what, when, recovery seconds
    # (service name, pid): its (seconds into the soak, RSS MB) samples
    rss: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)


async def clients(url: str, n: int, until: float, soak: Soak, seed: int) -> None:
    """`n` clients, each asking the next question as soon as the last is answered."""
    rng = random.Random(seed)
    pool = (p for p in iter(lambda: draw(rng), None) if held_out(p))  # held-out, endless
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def one() -> None:
            while time.monotonic() < until:
                p = next(pool)
                try:
                    r = await http.post("/v1/chat/completions", json={
                        "model": model, "messages": [{"role": "user", "content": p.question}],
                        "max_tokens": 8, "temperature": 0})
                except httpx.HTTPError as exc:
                    soak.failed += 1
                    soak.errors.append(repr(exc))
                    continue
                if r.status_code != 200:
                    soak.failed += 1
                    soak.errors.append(f"{r.status_code} {r.text[:200]}")
                    continue
                soak.ok += 1
                soak.correct += is_correct(p, r.json()["choices"][0]["message"]["content"]
                                           or "")

        await asyncio.gather(*(one() for _ in range(n)))


def killer(served: Served, every: float, until: float, soak: Soak, rng: random.Random,
           stop: threading.Event) -> None:
    """Every `every` s, SIGKILL a random service but the gateway; then time until /health
    answers 200 again."""
    while not stop.wait(every) and time.monotonic() < until:
        victims = {k: v for k, v in served.services().items() if k != "gateway"}
        name = rng.choice(sorted(victims))
        killed = time.monotonic()
        os.kill(victims[name], signal.SIGKILL)
        log(f"killed {name} (pid {victims[name]})")
        while not stop.is_set():  # until started again, and /health says all is well
            again = served.services().get(name)
            try:
                if again not in (None, victims[name]) and \
                        httpx.get(f"{served.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            stop.wait(0.1)  # polling /health: the recovery's resolution
        soak.kills.append({"service": name, "at_s": killed,
                           "recovery_s": time.monotonic() - killed})


def sampler(served: Served, soak: Soak, start: float, stop: threading.Event) -> None:
    while not stop.wait(RSS_EVERY_S):
        for name, pid in served.services().items():
            if (mb := rss_mb(pid)) is not None:
                soak.rss.setdefault((name, pid), []).append((time.monotonic() - start, mb))


def growth(rss: dict[tuple[str, int], list[tuple[float, float]]], warm_s: float
           ) -> dict[str, dict[str, float]]:
    """Per service, its longest-lived process's RSS once warm (its first sample at least
    `warm_s` into the soak and into its own life: a restarted process starts small and
    grows back) and its largest after; with how long that process was watched, and the
    largest RSS any of the service's processes had."""
    out: dict[str, dict[str, float]] = {}
    for (name, _), samples in rss.items():
        born = samples[0][0]
        warm = [(t, mb) for t, mb in samples if t >= warm_s and t - born >= warm_s]
        entry = out.setdefault(name, {"largest_mb": 0.0, "watched_s": 0.0})
        entry["largest_mb"] = max(entry["largest_mb"], max(mb for _, mb in samples))
        if warm and warm[-1][0] - warm[0][0] >= entry["watched_s"]:
            entry.update(watched_s=warm[-1][0] - warm[0][0], warm_mb=warm[0][1],
                         peak_mb=max(mb for _, mb in warm))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--kill-every", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--warm-up", type=float, default=60.0,
                    help="seconds after which resident memory is the baseline")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--check", action="store_true",
                    help="exit 1 on a failed request, a KV block left in use, or a kill "
                         "not recovered from")
    ap.add_argument("--out", type=Path, help="write the report, every RSS sample with it, "
                    "to this JSON file")
    ap.add_argument("serve_flags", nargs="*", help="after --: flags for switchyard serve")
    args = ap.parse_args()
    soak, rng, stop = Soak(), random.Random(args.seed), threading.Event()
    with Served(args.serve_flags, timeout=600) as served:
        start = time.monotonic()
        until = start + args.duration
        threads = [threading.Thread(target=killer, daemon=True, args=(
                       served, args.kill_every, until, soak, rng, stop)),
                   threading.Thread(target=sampler, daemon=True,
                                    args=(served, soak, start, stop))]
        for t in threads:
            t.start()
        log(f"{args.clients} clients for {args.duration:g} s, a kill every "
            f"{args.kill_every:g} s ...")
        asyncio.run(clients(served.url, args.clients, until, soak, args.seed))
        stop.set()
        for t in threads:
            t.join(120)
        stats = httpx.get(f"{served.url}/stats", timeout=30).json()
    kv_used = stats["kv_blocks_used"]
    report = {"ok": soak.ok, "failed": soak.failed,
              "accuracy": soak.correct / max(1, soak.ok), "kv_blocks_used_at_end": kv_used,
              "running_at_end": stats["num_running"],
              "kills": [{k: round(v, 2) if isinstance(v, float) else v
                         for k, v in kill.items() if k != "at_s"} for kill in soak.kills],
              "rss": growth(soak.rss, args.warm_up),
              "errors": soak.errors[:10]}
    print(json.dumps(report, indent=1))
    if args.out is not None:  # with every RSS sample, per process
        args.out.write_text(json.dumps({**report, "rss_samples": {
            f"{name} {pid}": samples for (name, pid), samples in sorted(soak.rss.items())}}))
    print(f"\n{args.duration:g} s, {args.clients} clients, a kill every {args.kill_every:g} s: "
          f"{soak.ok} ok, {soak.failed} failed, accuracy {100 * report['accuracy']:.1f}%, "
          f"KV blocks in use at the end {kv_used}")
    print("\n| service | its longest-lived process: RSS MB once warm | largest after | "
          "growth | over s | largest RSS MB of any of its processes |\n"
          "|---|---:|---:|---:|---:|---:|")
    for name, g in sorted(report["rss"].items()):
        if "warm_mb" in g:
            print(f"| {name} | {g['warm_mb']:.0f} | {g['peak_mb']:.0f} | "
                  f"{100 * (g['peak_mb'] / g['warm_mb'] - 1):+.1f}% | {g['watched_s']:.0f} | "
                  f"{g['largest_mb']:.0f} |")
        else:
            print(f"| {name} | (no process lived past warm-up) | | | | "
                  f"{g['largest_mb']:.0f} |")
    print("\n| kill | service | recovery s |\n|---:|---|---:|")
    for i, kill in enumerate(report["kills"], 1):
        print(f"| {i} | {kill['service']} | {kill['recovery_s']:.1f} |")
    recovered = all(k["recovery_s"] < args.kill_every * 4 for k in soak.kills)
    if args.check and (soak.failed or kv_used or not soak.kills or not recovered):
        print("chaos check failed", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
