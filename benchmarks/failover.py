""".venv/bin/python -m benchmarks.failover [--concurrency 8] [--phase-s 20]

Serving through a lost expert service: the rpc backend with each expert on two of
three expert services, one killed under load and started again.

The services run as separate processes, as compose runs them (`switchyard serve` would
restart the killed one at once): 3 expert services (`--expert-replicas 2`), an
attention service (`rpc`) and the gateway, on loopback, serving the bundled demo model.
`--concurrency` clients ask held-out demo questions back to back (chat, greedy), 3 s
to warm up, then three phases of `--phase-s` seconds: all up; expert rank 1 killed (SIGKILL) as the
second begins; started again on its port as the third begins. Per phase: requests
answered and failed, answers correct, output tokens/s, latency percentiles; and how
long after its restart the attention service had probed rank 1 back into its routing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass

import httpx

from common.ports import free_port
from switchyard.bench import percentile
from switchyard.children import Children
from switchyard.demo_model import DEFAULT_MODEL, DEFAULT_MODEL_NAME
from switchyard.demo_task import is_correct, problems

NUM_EXPERTS, LOST = 3, 1


@dataclass(frozen=True)
class Record:
    start: float
    end: float
    ok: bool
    correct: bool
    tokens: int


def expert(rank: int, port: int) -> tuple[str, list[str]]:
    return (f"expert {rank}", ["expert", "--model", str(DEFAULT_MODEL), "--rank", str(rank),
                               "--num-ranks", str(NUM_EXPERTS), "--expert-replicas", "2",
                               "--port", str(port), "--num-threads", "1"])


def start(children: Children, expert_ports: list[int]) -> str:
    """Experts, then the attention service, then the gateway; the gateway's URL."""
    children.start_all([expert(r, p) for r, p in enumerate(expert_ports)], timeout=120)
    [(engine, *_)] = children.start_all([("attention", [
        "attention", "--model", str(DEFAULT_MODEL), "--port", "0", "--dispatch-backend",
        "rpc", "--expert-replicas", "2", "--expert-addresses",
        ",".join(f"127.0.0.1:{p}" for p in expert_ports)])], timeout=120)
    [(http, *_)] = children.start_all([("gateway", [
        "gateway", "--model", str(DEFAULT_MODEL), "--served-model-name", DEFAULT_MODEL_NAME,
        "--engine", f"127.0.0.1:{engine}", "--port", "0"])], timeout=120)
    url = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/health", timeout=10).status_code != 200:  # connected to it all
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway did not become healthy within 60 s")
        time.sleep(0.1)
    return url


async def client(http: httpx.AsyncClient, worker: int, until: float,
                 out: list[Record]) -> None:
    asked = problems(seed=100 + worker, n=1000)
    for problem in asked:
        if time.monotonic() >= until:
            return
        began = time.monotonic()
        try:
            r = await http.post("/v1/chat/completions", json={
                "model": DEFAULT_MODEL_NAME, "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": problem.question}]})
            body = r.json() if r.status_code == 200 else None
        except httpx.HTTPError:
            body = None
        reply = body["choices"][0]["message"]["content"] if body else ""
        out.append(Record(began, time.monotonic(), body is not None,
                          body is not None and is_correct(problem, reply),
                          body["usage"]["completion_tokens"] if body else 0))


async def back_in_routing(http: httpx.AsyncClient, since: float, until: float
                          ) -> float | None:
    """Seconds from `since` until /health no longer calls rank 1 lost."""
    while time.monotonic() < until:
        lines = (await http.get("/health")).json()["attention"][0]["experts"]
        if not any(f"expert rank {LOST} at" in line and "lost" in line for line in lines):
            return time.monotonic() - since
        await asyncio.sleep(0.1)
    return None


async def run(url: str, children: Children, restarted: Children, port: int,
              concurrency: int, phase_s: float) -> tuple[list[Record], list[float], float | None]:
    records: list[Record] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        warm: list[Record] = []  # first requests: not in the phases
        await asyncio.gather(*(client(http, w, time.monotonic() + 3, warm)
                               for w in range(concurrency)))
        t0 = time.monotonic()
        end = t0 + 3 * phase_s
        workers = [asyncio.create_task(client(http, w, end, records))
                   for w in range(concurrency)]
        await asyncio.sleep(phase_s)
        killed = time.monotonic()
        lost = children.procs[LOST][1]
        lost.kill()
        await asyncio.to_thread(lost.wait)
        await asyncio.sleep(t0 + 2 * phase_s - time.monotonic())
        back = time.monotonic()
        await asyncio.to_thread(restarted.start_all, [expert(LOST, port)], 120)
        recovered = await back_in_routing(http, back, end)
        await asyncio.gather(*workers)
    return records, [t0, killed, back, end], recovered


def report(records: list[Record], marks: list[float], recovered: float | None) -> str:
    names = ["all 3 expert services", f"expert rank {LOST} killed",
             f"expert rank {LOST} restarted"]
    lines = ["| phase | requests ok | failed | correct | output tokens/s | latency p50 / "
             "p99 / max (s) |", "|---|---:|---:|---:|---:|---|"]
    for name, a, b in zip(names, marks[:-1], marks[1:], strict=True):
        done = [r for r in records if a <= r.end < b]
        ok = [r for r in done if r.ok]
        lat = [r.end - r.start for r in ok] or [0.0]
        lines.append(f"| {name} | {len(ok)} | {len(done) - len(ok)} | "
                     f"{sum(r.correct for r in ok) / max(1, len(ok)):.1%} | "
                     f"{sum(r.tokens for r in ok) / (b - a):.1f} | {percentile(lat, 50):.3f} / "
                     f"{percentile(lat, 99):.3f} / {max(lat):.3f} |")
    lines.append(f"\nrank {LOST} back in the routing "
                 f"{'never' if recovered is None else f'{recovered:.2f} s'} after its restart "
                 "began (its start-up included)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--phase-s", type=float, default=20.0)
    args = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `serve` sets it (benchmarks.md)
    ports = [free_port() for _ in range(NUM_EXPERTS)]
    children, restarted = Children(), Children()
    try:
        print("starting 3 expert services, attention, gateway ...", flush=True)
        url = start(children, ports)
        print(f"serving at {url}; {3 * args.phase_s:.0f} s of load ...", flush=True)
        records, marks, recovered = asyncio.run(run(url, children, restarted, ports[LOST],
                                                    args.concurrency, args.phase_s))
    finally:
        children.stop()
        restarted.stop()
    print(report(records, marks, recovered))


if __name__ == "__main__":
    main()
