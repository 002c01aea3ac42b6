"""Flags the service processes share, each defaulting to a `SWITCHYARD_*` variable, and
their forwarding from `switchyard serve` to the processes it starts.

Every other flag is defined once, in its service's `config.py`:

- `gateway/config.py`, with `add_serve_flags` for those `serve` takes too;
- `services/attention/config.py`, with `add_engine_flags`, which `serve` forwards, and
  `add_attention_parser`;
- `services/expert/config.py`;
- `ep_dispatch/deepep_config.py`, the `--deepep-*` settings both service kinds take.

`switchyard/cli.py` holds only `serve`'s own.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection

ENV_PREFIX = "SWITCHYARD_"


def env(name: str, default: str | None = None) -> str | None:
    """`SWITCHYARD_<name>`, or `default`."""
    return os.environ.get(ENV_PREFIX + name, default)


def env_switch(name: str, default: bool = False) -> bool:
    """A yes/no setting `SWITCHYARD_<name>`: unset is `default`; empty, 0 or false is no."""
    value = env(name)
    return default if value is None else value not in ("", "0", "false")


def optional_int(value: str | None) -> int | None:
    """An optional integer setting: unset or empty (`${VAR:-}` in an env file) is None."""
    return None if value in (None, "") else int(value)


def add_device_flag(p: argparse.ArgumentParser) -> argparse.Action:
    return p.add_argument("--device", default=env("DEVICE", "cpu"), choices=["cpu", "cuda"],
                          help="where to compute: cpu, or cuda (the process's current GPU: "
                               "pin one with CUDA_VISIBLE_DEVICES)")


def add_metrics_flag(p: argparse.ArgumentParser) -> argparse.Action:
    port = env("METRICS_PORT")
    return p.add_argument("--metrics-port", type=int, default=int(port) if port else None,
                          help="serve Prometheus /metrics on this port, on --host (0: a free "
                               "one; default: not served)")


def add_quantization_flag(p: argparse.ArgumentParser, w4a4: str) -> argparse.Action:
    return p.add_argument("--quantization", default=env("QUANTIZATION") or "auto",
                          choices=["auto", "none", "w4a4"],
                          help=f"auto (default): the checkpoint's; none: float experts "
                               f"(overrides {ENV_PREFIX}QUANTIZATION); {w4a4}")


def add_replicas_flag(p: argparse.ArgumentParser) -> argparse.Action:
    return p.add_argument("--expert-replicas", type=int,
                          default=int(env("EXPERT_REPLICAS") or 1),
                          help="without --placement: each expert on this many expert ranks "
                               "(balanced); the rpc backend routes around a lost rank while "
                               "every expert it holds has a replica (every service of a "
                               "deployment must be given the same)")


def add_rendezvous_flag(p: argparse.ArgumentParser) -> argparse.Action:
    # Ranks meet once loaded: an expert rank reads most of an MoE's weights first, which
    # takes minutes for a large model (torch's own TCPStore waits 300 s by default).
    return p.add_argument("--rendezvous-timeout", type=float,
                          default=float(env("RENDEZVOUS_TIMEOUT") or 300),
                          help="seconds the ranks of a lockstep world (torch, nccl, deepep "
                               "backends) or of a DCP group wait at start-up for every "
                               "rank to join")


def add_link_timeout_flag(p: argparse.ArgumentParser) -> argparse.Action:
    # 4 is common.rpc.LINK_TIMEOUT_S, not imported so this module stays free of the rpc stack
    return p.add_argument("--link-timeout", type=float,
                          default=float(env("LINK_TIMEOUT") or 4),
                          help="seconds a service connection's link may stay silent (no "
                               "data, no acknowledgement, no answer to keep-alive probes) "
                               "before its peer counts as dead, as a host whose link was "
                               "cut (it sends no reset), or that stopped reading; 0: the "
                               "kernel's defaults (hours)")


def as_flags(args: argparse.Namespace, actions: list[argparse.Action],
             skip: Collection[str] = ()) -> list[str]:
    """The command-line flags that give another process `args`' values of `actions`,
    except the destinations in `skip`. Values of None are left out, and a switch is given
    when set."""
    out: list[str] = []
    for action in actions:
        value = getattr(args, action.dest)
        if action.dest in skip or value is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):  # --x or --no-x
            out += [action.option_strings[0 if value else 1]]
        elif action.nargs == 0:  # a switch: store_true and the like
            out += [action.option_strings[0]] if value else []
        else:
            out += [action.option_strings[0], str(value)]
    return out
