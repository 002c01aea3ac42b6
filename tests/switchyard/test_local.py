"""`serve`'s rendering of the topology (`switchyard.local`): every child's command is one
its service parses, with the ports and addresses of the others; the collective world's
experts join as their world rank; each child is found again by `service_name` (what the
tests and the chaos soak kill by). Run for real: every `serve` test."""

from __future__ import annotations

import argparse
import re

import pytest

from services.attention.config import add_attention_parser, from_args
from services.expert.config import add_expert_parser, expert_config
from switchyard.cli import _serve_parser
from switchyard.demo_model import DEFAULT_MODEL
from switchyard.local import render
from switchyard.serve_process import service_name


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    _serve_parser(sub)
    add_attention_parser(sub)
    add_expert_parser(sub)
    return parser.parse_args(argv)


def _children(flags: list[str], experts: int) -> dict[str, list[str]]:
    services = render(_parse(["serve", *flags]), DEFAULT_MODEL, "m", experts, [])
    return dict([*services.experts, *services.attention, services.gateway])


def _flag(argv: list[str], flag: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


@pytest.mark.parametrize(("flags", "experts"), [
    ([], 2), (["--dcp-size", "2", "--attention-groups", "2"], 3),
    (["--dispatch-backend", "torch", "--attention-groups", "2"], 3),
    (["--dispatch-backend", "local"], 0)])
def test_every_child_parses_and_finds_the_others(flags: list[str], experts: int) -> None:
    children = _children(flags, experts)
    ports: list[str] = []
    for name, argv in children.items():
        if argv[0] == "gateway":
            continue
        args = _parse(argv)
        assert args.model == str(DEFAULT_MODEL)
        ports += [str(args.metrics_port)] + ([str(args.port)] if args.port else [])
        if argv[0] == "expert":
            assert f"expert rank {expert_config(args).rank}" == name
        else:
            config = from_args(args)
            assert config.host == "127.0.0.1"
            if config.dispatch_backend == "rpc":
                assert [f"{h}:{p}" for h, p in config.expert_addresses] == \
                    [f"127.0.0.1:{_flag(children[f'expert rank {r}'], '--port')}"
                     for r in range(experts)]
        assert service_name(["python", "-m", "switchyard", *argv]) is not None
    assert len(ports) == len(set(ports)), "two children on one port"
    gateway = children["gateway"]
    leaders = [a for n, a in children.items() if re.fullmatch(r"attention group \d+", n)]
    assert _flag(gateway, "--engine").split(",") == \
        [f"127.0.0.1:{_flag(a, '--port')}" for a in leaders]


def test_a_worlds_expert_ranks_follow_its_attention_ranks() -> None:
    children = _children(["--dispatch-backend", "torch", "--attention-groups", "2"], 3)
    for r in range(3):
        argv = children[f"expert rank {r}"]
        assert _flag(argv, "--world-rank") == str(2 + r)
        assert service_name(["switchyard", *argv]) == f"expert rank {r}"
    inits = {_flag(a, "--dist-init") for n, a in children.items() if n != "gateway"}
    assert len(inits) == 1  # one rendezvous


def test_a_dcp_peer_is_named_with_its_leader() -> None:
    children = _children(["--dcp-size", "2", "--attention-groups", "2"], 2)
    names = {service_name(["switchyard", *a]) for n, a in children.items()
             if n.startswith("attention")}
    assert len(names) == 4  # each group's leader and peer, apart
    for g in range(2):
        leader = service_name(["switchyard", *children[f"attention group {g}"]])
        peer = service_name(["switchyard", *children[f"attention group {g} DCP rank 1"]])
        assert peer == f"{leader} DCP rank 1"


def test_serves_own_flags_reach_the_services() -> None:
    children = _children(["--quantization", "w4a4", "--kv-cache-memory", "64MiB",
                          "--max-num-seqs", "7", "--expert-replicas", "2",
                          "--otlp-traces-endpoint", "http://x:4318", "--api-key", "k"], 2)
    attention = from_args(_parse(children["attention group 0"]))
    assert (attention.kv_cache_memory, attention.max_num_seqs, attention.expert_replicas) \
        == (64 << 20, 7, 2)
    expert = expert_config(_parse(children["expert rank 1"]))
    assert (expert.quantization, expert.expert_replicas) == ("w4a4", 2)
    assert expert.otlp_traces_endpoint == "http://x:4318"
    assert "--otlp-traces-endpoint" in children["gateway"]
