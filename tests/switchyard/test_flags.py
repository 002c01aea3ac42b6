"""Flags: `serve` forwards every engine and gateway flag it takes to its services, whatever
it is, and the services take their model from the environment."""

from __future__ import annotations

import argparse

import pytest

from common.flags import as_flags
from common.units import parse_size


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    from services.attention.config import add_attention_parser
    from switchyard.cli import _serve_parser

    root = argparse.ArgumentParser()
    sub = root.add_subparsers(dest="command")
    _serve_parser(sub)
    add_attention_parser(sub)
    return sub.choices["serve"], sub.choices["attention"]


def _other_value(action: argparse.Action) -> str:
    """A valid value for `action` that is not its default."""
    if action.choices:
        return next(str(c) for c in action.choices if c != action.default)
    if action.type is int:
        return str((action.default or 0) + 3)
    if action.type is float:
        return str((action.default or 0) + 1.5)
    if action.type is parse_size:
        return "3MiB"
    if action.dest == "speculative_config":  # checked JSON
        return '{"method": "ngram", "num_speculative_tokens": 2}'
    if action.dest == "otlp_ui_url":  # checked: a URL with the trace id's place
        return "http://ui.example:16686/trace/{trace_id}"
    return f"{action.dest}-value"


def _other_flags(action: argparse.Action) -> list[str]:
    """The flags that give `action` a valid value that is not its default."""
    if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x
        return [action.option_strings[1 if action.default else 0]]
    if action.nargs == 0:  # a switch (store_true)
        return [action.option_strings[0]]
    return [action.option_strings[0], _other_value(action)]


def test_serve_forwards_every_engine_flag_to_the_attention_services(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine flag given to `serve` reaches the attention service as `serve` renders
    it (`switchyard.local`), whether the topology writes it or passes it on."""
    from services.attention.config import add_engine_flags
    from switchyard.demo_model import DEFAULT_MODEL
    from switchyard.local import render

    for name in ("DISPATCH_BACKEND", "QUANTIZATION", "DTYPE", "DEVICE", "DIST_INIT"):
        monkeypatch.delenv(f"SWITCHYARD_{name}", raising=False)
    serve, attention = _parsers()
    engine = add_engine_flags(argparse.ArgumentParser())
    argv = [arg for a in engine for arg in _other_flags(a)]
    # (a collective world has no DCP group: --dcp-size is checked with rpc below)
    given = serve.parse_args([*argv, "--dispatch-backend", "torch", "--dcp-size", "1"])
    [(_, leader)] = render(given, DEFAULT_MODEL, "m", 2, []).attention
    got = attention.parse_args(leader[1:])
    for action in engine:
        if action.dest not in ("dist_init", "dcp_size"):  # (each world its own rendezvous)
            assert getattr(got, action.dest) == getattr(given, action.dest), action.dest
            assert getattr(got, action.dest) != action.default, action.dest
    given = serve.parse_args([*argv, "--dispatch-backend", "rpc", "--dcp-size", "3"])
    group = render(given, DEFAULT_MODEL, "m", 2, []).attention
    assert [attention.parse_args(a[1:]).dcp_size for _, a in group] == [3, 3, 3]


def test_serve_forwards_every_gateway_flag_it_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """`add_serve_flags` defines the gateway flags `serve` takes too, once: each reaches
    the gateway's own parser through `serve_flags` with the value given to serve."""
    from gateway.config import _parser, add_serve_flags, serve_flags

    for name in ("GENERATION_CONFIG", "TOOL_CALL_PARSER", "ROUTING_POLICY"):
        monkeypatch.delenv(f"SWITCHYARD_{name}", raising=False)
    serve, _ = _parsers()
    probe = argparse.ArgumentParser()
    add_serve_flags(probe)
    shared = [a for a in probe._actions if a.option_strings and a.dest != "help"]
    given = serve.parse_args([arg for a in shared for arg in _other_flags(a)])
    got = _parser().parse_args(["--model", "m", "--engine", "h:1", *serve_flags(given)])
    for action in shared:
        assert getattr(got, action.dest) == getattr(given, action.dest), action.dest
        assert getattr(got, action.dest) != action.default, action.dest


def test_serve_gives_its_gateway_the_access_flags_and_the_keys_by_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys reach the gateway through its environment, never its command line (which `ps`
    shows); the other access flags as flags, with the values given to serve."""
    from gateway.config import _parser, access_flags, access_settings

    for name in ("API_KEY", "ADMIN_API_KEY", "ALLOWED_ORIGINS"):
        monkeypatch.delenv(f"SWITCHYARD_{name}", raising=False)
    serve, _ = _parsers()
    given = serve.parse_args(["--api-key", "k1", "--api-key", "k2", "--admin-api-key", "adm",
                              "--allowed-origins", '["https://a.example"]',
                              "--allowed-headers", "authorization"])
    flags, env = access_flags(given)
    assert not any(k in " ".join(flags) for k in ("k1", "k2", "adm"))
    assert env == {"SWITCHYARD_API_KEY": "k1,k2", "SWITCHYARD_ADMIN_API_KEY": "adm"}
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    got = _parser().parse_args(["--model", "m", "--engine", "h:1", *flags])
    assert access_settings(got, "127.0.0.1") == access_settings(given, "127.0.0.1")
    access, _, cors = access_settings(got, "0.0.0.0")
    assert access.api_keys == (b"k1", b"k2") and access.admin_api_keys == (b"adm",)
    assert not access.loopback and cors.allowed_origins == ("https://a.example",)
    assert "k1" not in repr(access)


def test_as_flags_gives_values_and_switches_and_leaves_out_what_is_unset() -> None:
    p = argparse.ArgumentParser()
    actions = [p.add_argument("--n", type=int), p.add_argument("--on", action="store_true"),
               p.add_argument("--off", action="store_true"), p.add_argument("--name"),
               p.add_argument("--skipped")]
    args = p.parse_args(["--n", "4", "--on", "--skipped", "x"])
    assert as_flags(args, actions, skip={"skipped"}) == ["--n", "4", "--on"]
    assert p.parse_args(as_flags(args, actions)) == args


def test_attention_and_expert_services_take_their_model_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SWITCHYARD_MODEL, as the gateway and `serve` take it (they required --model)."""
    import argparse

    from services.attention.config import add_attention_parser
    from services.expert.config import add_expert_parser

    def parse(argv: list[str]) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        sub = parser.add_subparsers(dest="command", required=True)
        add_attention_parser(sub)
        add_expert_parser(sub)
        return parser.parse_args(argv)

    monkeypatch.setenv("SWITCHYARD_MODEL", "/models/from-env")
    assert parse(["attention"]).model == parse(["expert"]).model == "/models/from-env"
    assert parse(["expert", "--model", "/flag"]).model == "/flag"  # the flag wins
    monkeypatch.delenv("SWITCHYARD_MODEL")
    with pytest.raises(SystemExit):
        parse(["attention"])  # neither: --model is required


def test_expert_placement_is_placement_for_serve_and_the_services() -> None:
    """SGLang's name for a placement file to start balanced with, as `--placement`."""
    from services.expert.config import add_expert_parser

    serve, attention = _parsers()
    root = argparse.ArgumentParser()
    add_expert_parser(root.add_subparsers(dest="command"))
    given = ["--model", "m", "--expert-placement", "p.json"]
    assert serve.parse_args(given).placement == "p.json"
    assert attention.parse_args(given).placement == "p.json"
    assert root.parse_args(["expert", *given]).placement == "p.json"


def test_an_expert_rank_from_its_world_rank() -> None:
    """`--world-rank` (a LeaderWorkerSet worker's index) less the attention ranks is the
    expert rank; one that is no expert rank of the world, or without a collective
    backend, is an error that says so."""
    from services.expert.config import add_expert_parser, expert_config

    root = argparse.ArgumentParser()
    add_expert_parser(root.add_subparsers(dest="command"))

    def config(*flags: str) -> object:
        return expert_config(root.parse_args(["expert", "--model", "m", "--num-ranks", "3",
                                              *flags]))

    assert config("--dispatch-backend", "torch", "--world-rank", "1").rank == 0
    assert config("--dispatch-backend", "torch", "--world-rank", "4",
                  "--attention-ranks", "2").rank == 2
    for bad in (["--dispatch-backend", "torch", "--world-rank", "0"],  # attention's
                ["--dispatch-backend", "torch", "--world-rank", "4"],
                ["--world-rank", "1"]):  # rpc: no world
        with pytest.raises(ValueError, match="not an expert rank of a collective world"):
            config(*bad)


def test_an_empty_quantization_variable_means_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """`SWITCHYARD_QUANTIZATION=` (what `${VAR:-}` in an env file gives) is not a choice
    argparse would check: it must read as the default."""
    import argparse

    from services.attention.config import add_engine_flags

    monkeypatch.setenv("SWITCHYARD_QUANTIZATION", "")
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert parser.parse_args([]).quantization == "auto"
