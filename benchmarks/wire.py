""".venv/bin/python -m benchmarks.wire [--delays-ms 0 0.5 2 5] [--concurrency 1 16]
                                    [--micro-batches 1 2 3] [--output-len 64]

What wire latency between the attention service and its expert
services adds to TPOT, with the step in 1, 2 or 3 micro-batches (the ping-pong pipeline).

The default topology of `serve` (rendered by `switchyard.local`: gateway, one attention
service, two expert services over `rpc`) on the mid-size checkpoint, with a delaying TCP
proxy (`tests.support.delay_proxy`, a process of its own) between the attention service
and each expert service, holding every chunk the set time in each direction (this kernel
has no `netem`). One topology per (micro-batches, delay), loaded by `switchyard bench`'s
client at each concurrency with the same fixed-seed prompts; float32, greedy, exactly
`--output-len` tokens a request. Reports the median TPOT, and what the delay added over
the same micro-batch count without delay, and the share of the wire's round trips
(layers x 2 x delay) that this hid.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.generate import add_workdir_flag, build_checkpoint
from benchmarks.serving import healthy, log, measured_rows
from common.auth import SECRET_ENV, ClusterSecret
from common.flags import ENV_PREFIX
from common.ports import free_port
from services.model.config import ModelConfig
from switchyard.bench import make_prompts
from switchyard.children import Children
from switchyard.local import LocalServices, render
from tests.support.netns import read_line
from tests.support.tools import wait_until

EXPERT_SERVICES = 2


def _serve_args(path: Path, micro_batches: str) -> argparse.Namespace:
    from switchyard.cli import _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", "--model", str(path), "--kv-cache-memory", "1GiB",
                              "--expert-services", str(EXPERT_SERVICES), "--micro-batches",
                              micro_batches, "--port", "0"])


@contextlib.contextmanager
def proxies(targets: list[str], delay_ms: float) -> Iterator[list[str]]:
    """A delaying proxy process before each HOST:PORT; their addresses."""
    procs, addresses = [], []
    try:
        for target in targets:
            listen = f"127.0.0.1:{free_port()}"
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.delay_proxy", "--listen", listen,
                 "--to", target, "--delay-ms", str(delay_ms)],
                stdout=subprocess.PIPE, bufsize=0)
            procs.append(proc)
            addresses.append(read_line(proc, 30).removeprefix("listening "))
        yield addresses
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


@dataclass
class DelayedExperts:
    services: LocalServices  # the topology, its attention service's --expert-addresses
    secret: ClusterSecret  # (the proxies' there) the one its services want proved
    children: Children


@contextlib.contextmanager
def delayed_experts(path: Path, micro_batches: str, delay_ms: float
                    ) -> Iterator[DelayedExperts]:
    """The default topology's expert services started, each behind a delaying proxy that
    its attention service's command now points at (the other services not started)."""
    services = render(_serve_args(path, micro_batches), path, "wire", EXPERT_SERVICES, [])
    [(_, attention)] = services.attention
    at = attention.index("--expert-addresses") + 1
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `serve` runs them
    with tempfile.TemporaryDirectory() as tmp:
        secret = ClusterSecret.generate()
        os.environ[ENV_PREFIX + SECRET_ENV] = str(secret.write(Path(tmp) / "secret"))
        children = Children()
        try:
            children.start_all(services.experts, 600)
            with proxies(attention[at].split(","), delay_ms) as addresses:
                attention[at] = ",".join(addresses)
                yield DelayedExperts(services, secret, children)
        finally:
            children.stop()
            del os.environ[ENV_PREFIX + SECRET_ENV]


@contextlib.contextmanager
def delayed_topology(path: Path, micro_batches: str, delay_ms: float) -> Iterator[str]:
    """The default topology with the proxies between attention and experts; its URL."""
    with delayed_experts(path, micro_batches, delay_ms) as delayed:
        children, services = delayed.children, delayed.services
        children.start_all(services.attention, 600)
        [(port,)] = children.start_all([services.gateway], 600)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: healthy(url), 600, lambda: f"{url}/health")
        yield url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workdir_flag(ap)
    ap.add_argument("--delays-ms", type=float, nargs="+", default=[0, 0.5, 2, 5])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--micro-batches", nargs="+", default=["1", "2", "3"])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    path = build_checkpoint(args.workdir)
    moe_layers = len(ModelConfig.from_dir(path).moe_layer_ids)
    prompts = make_prompts(max(max(args.concurrency), 4), args.input_len, 0.0, 200, seed=0)
    tpot: dict[tuple[str, float, int], float] = {}
    for mb in args.micro_batches:
        for delay in args.delays_ms:
            log(f"--micro-batches {mb}, {delay:g} ms one way: starting ...")
            with delayed_topology(path, mb, delay) as url:
                rows = measured_rows(url, prompts, args.concurrency, args.output_len)
            for c, row in rows.items():
                tpot[mb, delay, c] = row["tpot"]["median_ms"]
    print(f"{moe_layers} MoE layers; {args.input_len} input + {args.output_len} output "
          "tokens, float32; TPOT median ms (added by the delay; share of the wire's "
          "round trips hidden)\n")
    print("| one-way delay | concurrency | " +
          " | ".join(f"--micro-batches {mb}" for mb in args.micro_batches) + " |")
    print("|---:|---:|" + "---:|" * len(args.micro_batches))
    base = args.delays_ms[0]
    for delay in args.delays_ms:
        for c in args.concurrency:
            cells = []
            for mb in args.micro_batches:
                t, added = tpot[mb, delay, c], tpot[mb, delay, c] - tpot[mb, base, c]
                wire = moe_layers * 2 * (delay - base)
                cells.append(f"{t:.1f}" if delay == base else
                             f"{t:.1f} (+{added:.1f}; {1 - added / wire:.0%} hidden)")
            print(f"| {delay:g} ms | {c} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
