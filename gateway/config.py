"""The gateway's settings: one frozen `GatewayConfig`, built once from flags.

Every flag takes its default from a `SWITCHYARD_*` environment variable, so a deployment
can configure the gateway either way without code changes.
"""

from __future__ import annotations

import argparse
import json
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.auth import NO_SECRET, ClusterSecret, add_secret_flag, is_loopback
from common.flags import ENV_PREFIX, add_link_timeout_flag, env, env_switch, optional_int
from common.rpc import parse_address
from common.units import parse_size
from gateway.access import Access
from gateway.generation_config import NEUTRAL, SamplingDefaults
from gateway.observability.dashboard.recorder import HISTORY_S
from gateway.observability.service_metrics import check_url
from gateway.parsers.registry import TOOL_PARSERS
from gateway.routing.prefix_affinity import POLICIES
from gateway.routing.rebalancer import EplbConfig


@dataclass(frozen=True)
class Tls:
    """HTTPS, set with vLLM's flags and passed to uvicorn.

    Without a keyfile the gateway serves plain HTTP. With `ca_certs` and `cert_reqs` set to
    ssl.CERT_REQUIRED, clients must present a certificate signed by those CAs.
    """

    keyfile: Path | None = None
    certfile: Path | None = None
    ca_certs: Path | None = None
    cert_reqs: int = 0  # ssl.CERT_NONE


@dataclass(frozen=True)
class Cors:
    """Cross-origin browser access, set with vLLM's flags. By default no origin is allowed."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)


@dataclass(frozen=True)
class GatewayConfig:
    """Everything a deployment may change about the gateway."""

    model_dir: Path
    served_model_name: str
    engines: tuple[tuple[str, int], ...]
    host: str = "127.0.0.1"
    port: int = 8000
    ready_fd: int | None = None
    max_model_len: int | None = None
    log_level: str = "warning"
    access_log: bool = False
    shutdown_timeout_s: float = 5.0
    max_request_body_bytes: int = 16 << 20
    max_queued_requests: int = 256  # beyond what the engines run at once
    retry_after_s: int = 1
    otlp_traces_endpoint: str | None = None
    service_metrics: tuple[str, ...] = ()  # /metrics URLs of the attention and expert services
    dashboard_window_s: float = 60.0  # the window /dashboard shows first
    dashboard_interval_s: float = 5.0  # between the dashboard's readings
    otlp_ui_url: str | None = None  # a trace's page, with {trace_id}
    # Sampling defaults for what a request leaves out, for example from the model's
    # generation_config.json. Set with --generation-config.
    sampling_defaults: SamplingDefaults = NEUTRAL
    # How the model writes tool calls. When auto tool choice is enabled, this parser reads
    # the calls out of the text for tool_choice "auto". Its call ids are used always.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    enable_prompt_tokens_details: bool = False  # report usage.prompt_tokens_details, as vLLM does
    routing_policy: str = "prefix-affinity"  # which attention group takes a request
    routing_balance: int = 16  # requests in flight a group may have above the least busy
    failover_timeout_s: float = 60.0  # how long a dead group's request waits for a new group
    eplb: EplbConfig = field(default_factory=EplbConfig)  # expert load balancing (EPLB)
    access: Access = field(default_factory=Access)  # API keys (`gateway.access`)
    tls: Tls = field(default_factory=Tls)
    cors: Cors = field(default_factory=Cors)
    secret: ClusterSecret = NO_SECRET  # proven on connections to attention services
    link_timeout_s: float = 5.0  # an attention service silent this long is gone


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    engine = env("ENGINE")
    p.add_argument("--model", default=env("MODEL"), required=env("MODEL") is None,
                   help="checkpoint directory (tokenizer.json, tokenizer_config.json)")
    p.add_argument("--served-model-name", default=env("SERVED_MODEL_NAME"),
                   help="model name clients use (default: the model directory's name)")
    p.add_argument("--engine", default=engine, required=engine is None,
                   help="attention service address(es), HOST:PORT[,HOST:PORT...]: one per "
                        "attention group; requests go to the least busy")
    p.add_argument("--host", default=env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("PORT") or 8000),
                   help="HTTP port; 0 picks a free one")
    p.add_argument("--ready-fd", type=int, default=optional_int(env("READY_FD")),
                   help="write the bound port to this file descriptor, then close it")
    p.add_argument("--max-model-len", type=int, default=optional_int(env("MAX_MODEL_LEN")),
                   help="context length cap (default: the engine's)")
    p.add_argument("--log-level", default=env("LOG_LEVEL", "warning"), type=str.lower,
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true",
                   default=env_switch("ACCESS_LOG"))
    p.add_argument("--shutdown-timeout", type=float,
                   default=float(env("SHUTDOWN_TIMEOUT") or 5),
                   help="seconds open streams get to finish on shutdown")
    p.add_argument("--retry-after", type=int, default=int(env("RETRY_AFTER") or 1),
                   help="seconds a 429 tells the client to wait")
    p.add_argument("--otlp-traces-endpoint", default=env("OTLP_TRACES_ENDPOINT"),
                   help="OTLP traces URL (or set the OTEL_EXPORTER_OTLP_* variables)")
    p.add_argument("--service-metrics", default=env("SERVICE_METRICS", ""),
                   help="the attention and expert services' /metrics URLs, comma-separated: "
                        "merged into the gateway's /metrics and shown on /dashboard")
    add_serve_flags(p)
    add_access_flags(p)
    add_secret_flag(p)
    add_link_timeout_flag(p)
    return p


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """Add the gateway's flags that `switchyard serve` also takes.

    `serve` passes them on to the gateway with `serve_flags`.
    """
    add_tool_call_flags(p)
    p.add_argument("--max-request-body-size", type=parse_size,
                   default=parse_size(env("MAX_REQUEST_BODY_SIZE", "16MiB")),
                   help="larger request bodies get 413")
    p.add_argument("--max-queued-requests", type=int,
                   default=int(env("MAX_QUEUED_REQUESTS") or 256),
                   help="requests (choices) that may wait beyond what the engines run at "
                        "once; more get 429 with Retry-After")
    p.add_argument("--generation-config", default=env("GENERATION_CONFIG", "auto"),
                   help="sampling defaults for what a request leaves out: auto (the model's "
                        "generation_config.json, as vLLM), vllm (neutral: temperature 1, "
                        "no top-p/top-k), or a directory holding a generation_config.json")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   default=env_switch("ENABLE_PROMPT_TOKENS_DETAILS"),
                   help="report usage.prompt_tokens_details.cached_tokens (prompt tokens "
                        "found in the prefix cache), as vLLM's flag of that name")
    p.add_argument("--routing-policy", default=env("ROUTING_POLICY", "prefix-affinity"),
                   choices=POLICIES,
                   help="which attention group takes a request: prefix-affinity (the one "
                        "its prompt's first blocks were last sent to, if within "
                        "--routing-balance of the least busy; else the least busy) or "
                        "least-busy")
    p.add_argument("--routing-balance", type=int,
                   default=int(env("ROUTING_BALANCE") or 16),
                   help="prefix-affinity: requests in flight a group may have beyond the "
                        "least busy one and still be chosen for its cached prefix")
    p.add_argument("--failover-timeout", type=float,
                   default=float(env("FAILOVER_TIMEOUT") or 60),
                   help="seconds a request whose attention group died waits for a group "
                        "to take it over (another one, or the same one restarted) before "
                        "it fails with 503")
    add_eplb_flags(p)
    add_dashboard_flags(p)


def add_dashboard_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dashboard-window", type=float,
                   default=float(env("DASHBOARD_WINDOW") or 60),
                   help="seconds of recent load /dashboard shows until another window is "
                        f"chosen (at most {HISTORY_S:g})")
    p.add_argument("--dashboard-interval", type=float,
                   default=float(env("DASHBOARD_INTERVAL") or 5),
                   help="seconds between the dashboard's readings of every service (its "
                        "time series' resolution)")
    p.add_argument("--otlp-ui-url", default=env("OTLP_UI_URL"),
                   help="a trace's page in your tracing UI, with {trace_id} where its id "
                        "goes: http://jaeger:16686/trace/{trace_id} (Jaeger) or "
                        "http://phoenix:6006/redirects/traces/{trace_id} (Phoenix); the "
                        "dashboard links each slow request to it")


def dashboard_flags(args: argparse.Namespace) -> list[str]:
    """Return the flags of `add_dashboard_flags` as given.

    Raises ValueError for a value out of range.
    """
    if not 0 < args.dashboard_window <= HISTORY_S:
        raise ValueError(f"--dashboard-window must be in (0, {HISTORY_S:g}] seconds")
    if not 0 < args.dashboard_interval <= 60:
        raise ValueError("--dashboard-interval must be in (0, 60] seconds")
    if args.otlp_ui_url is not None:
        if "{trace_id}" not in args.otlp_ui_url:
            raise ValueError("--otlp-ui-url must hold {trace_id} where a trace's id goes")
        check_url(args.otlp_ui_url.replace("{trace_id}", "0" * 32))
    return ["--dashboard-window", str(args.dashboard_window),
            "--dashboard-interval", str(args.dashboard_interval),
            *(["--otlp-ui-url", args.otlp_ui_url] if args.otlp_ui_url else [])]


def add_access_flags(p: argparse.ArgumentParser) -> None:
    """Add the flags for who may call the gateway: API keys, TLS and CORS, as in vLLM.

    `serve` takes them too. It gives the keys to its gateway through the environment,
    not on its command line.
    """
    p.add_argument("--api-key", action="append", default=None,
                   help="a key clients must send as 'Authorization: Bearer <key>' to every "
                        "endpoint but /health and /metrics (repeatable; "
                        "SWITCHYARD_API_KEY: comma-separated)")
    p.add_argument("--admin-api-key", action="append", default=None,
                   help="a key for the operator endpoints (/eplb*, /stats, the dashboard's "
                        "data); without one they answer only on a loopback --host "
                        "(repeatable; SWITCHYARD_ADMIN_API_KEY: comma-separated)")
    p.add_argument("--ssl-keyfile", default=env("SSL_KEYFILE"), help="serve HTTPS: the key")
    p.add_argument("--ssl-certfile", default=env("SSL_CERTFILE"),
                   help="serve HTTPS: the certificate (chain)")
    p.add_argument("--ssl-ca-certs", default=env("SSL_CA_CERTS"),
                   help="CA certificates that sign the client certificates clients must "
                        "present (mutual TLS)")
    p.add_argument("--ssl-cert-reqs", type=int, default=optional_int(env("SSL_CERT_REQS")),
                   help="ssl.CERT_NONE (0), CERT_OPTIONAL (1) or CERT_REQUIRED (2) for "
                        "client certificates (default: 2 with --ssl-ca-certs, else 0)")
    p.add_argument("--allowed-origins", default=env("ALLOWED_ORIGINS", ""),
                   help="origins browsers may call from (CORS), a JSON list or "
                        "comma-separated; default: none")
    p.add_argument("--allowed-methods", default=env("ALLOWED_METHODS", "*"),
                   help="CORS: allowed methods (JSON list or comma-separated)")
    p.add_argument("--allowed-headers", default=env("ALLOWED_HEADERS", "*"),
                   help="CORS: allowed request headers (JSON list or comma-separated)")


def _keys(given: list[str] | None, variable: str) -> tuple[bytes, ...]:
    keys = given if given is not None else (env(variable) or "").split(",")
    return tuple(k.strip().encode() for k in keys if k.strip())


def _names(text: str) -> tuple[str, ...]:
    """Parse a JSON list of strings, the form vLLM takes, or a comma-separated list."""
    if text.lstrip().startswith("["):
        items = json.loads(text)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"expected a JSON list of strings, got {text!r}")
        return tuple(items)
    return tuple(t.strip() for t in text.split(",") if t.strip())


def access_settings(args: argparse.Namespace, host: str) -> tuple[Access, Tls, Cors]:
    """Turn the access flags into the gateway's settings.

    Raises ValueError naming a bad flag.
    """
    access = Access(_keys(args.api_key, "API_KEY"), _keys(args.admin_api_key, "ADMIN_API_KEY"),
                    loopback=is_loopback(host))
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        if (path := getattr(args, flag)) and not Path(path).is_file():
            raise ValueError(f"--{flag.replace('_', '-')}: {path} is not a file")
    if args.ssl_ca_certs and not args.ssl_certfile:
        raise ValueError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile (HTTPS)")
    reqs = args.ssl_cert_reqs if args.ssl_cert_reqs is not None else \
        (ssl.CERT_REQUIRED if args.ssl_ca_certs else ssl.CERT_NONE)
    if reqs not in (0, 1, 2):
        raise ValueError("--ssl-cert-reqs must be 0, 1 or 2")
    tls = Tls(*(Path(p) if p else None for p in (args.ssl_keyfile, args.ssl_certfile,
                                                  args.ssl_ca_certs)), int(reqs))
    try:
        cors = Cors(_names(args.allowed_origins), _names(args.allowed_methods),
                    _names(args.allowed_headers))
    except ValueError as exc:
        raise ValueError(f"--allowed-origins/-methods/-headers: {exc}") from None
    return access, tls, cors


def access_flags(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """Return the access flags as given, as (flags, environment), for a launcher to pass on.

    The keys go in the environment, where `ps` does not show them.
    """
    flags = [f for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs")
             if getattr(args, name) for f in (f"--{name.replace('_', '-')}",
                                               str(Path(getattr(args, name)).resolve()))]
    if args.ssl_cert_reqs is not None:
        flags += ["--ssl-cert-reqs", str(args.ssl_cert_reqs)]
    flags += ["--allowed-origins", args.allowed_origins, "--allowed-methods",
              args.allowed_methods, "--allowed-headers", args.allowed_headers]
    environment = {f"{ENV_PREFIX}{variable}": b",".join(keys).decode()
                   for variable, keys in (("API_KEY", _keys(args.api_key, "API_KEY")),
                                          ("ADMIN_API_KEY", _keys(args.admin_api_key,
                                                                  "ADMIN_API_KEY")))
                   if keys}
    return flags, environment


def add_eplb_flags(p: argparse.ArgumentParser) -> None:
    """Add the flags for expert load balancing (EPLB) while serving, as in vLLM and SGLang."""
    p.add_argument("--enable-eplb", action="store_true", default=env_switch("ENABLE_EPLB"),
                   help="move experts between the expert services by their measured load "
                        "while serving (rpc dispatch backend): every --eplb-interval steps, "
                        "and on POST /eplb/rebalance")
    p.add_argument("--eplb-interval", type=int, default=int(env("EPLB_INTERVAL") or 3000),
                   help="engine steps (over all attention groups) between rebalances; 0: "
                        "only when asked (POST /eplb/rebalance)")
    p.add_argument("--eplb-window", type=int, default=int(env("EPLB_WINDOW") or 1000),
                   help="engine steps of routing load a rebalance balances")
    p.add_argument("--num-redundant-experts", type=int,
                   default=int(env("NUM_REDUNDANT_EXPERTS") or 0),
                   help="extra copies of the heaviest experts a rebalance places (experts + "
                        "this must divide evenly over the expert services)")
    p.add_argument("--eplb-num-groups", type=int, default=optional_int(env("EPLB_NUM_GROUPS")),
                   help="expert groups for EPLB's hierarchical packing (default: the "
                        "router's n_group, else 1)")
    p.add_argument("--eplb-num-nodes", type=int, default=int(env("EPLB_NUM_NODES") or 1),
                   help="nodes the expert services are spread over (EPLB packs groups "
                        "onto nodes first where they divide)")


def eplb_config(args: argparse.Namespace) -> EplbConfig:
    """Collect the EPLB flags into one config. Raises ValueError for a value out of range."""
    if args.eplb_interval < 0 or args.eplb_window < 1 or args.num_redundant_experts < 0 \
            or args.eplb_num_nodes < 1 or (args.eplb_num_groups or 1) < 1:
        raise ValueError("--eplb-interval and --num-redundant-experts must not be negative; "
                         "--eplb-window, --eplb-num-groups and --eplb-num-nodes must be "
                         "positive")
    return EplbConfig(args.enable_eplb, args.eplb_interval, args.eplb_window,
                      args.num_redundant_experts, args.eplb_num_groups, args.eplb_num_nodes)


def eplb_flags(args: argparse.Namespace) -> list[str]:
    """The EPLB flags as given, for a launcher to pass on."""
    eplb_config(args)
    return [*["--enable-eplb"] * args.enable_eplb,
            "--eplb-interval", str(args.eplb_interval), "--eplb-window", str(args.eplb_window),
            "--num-redundant-experts", str(args.num_redundant_experts),
            *(["--eplb-num-groups", str(args.eplb_num_groups)] if args.eplb_num_groups
              else []),
            "--eplb-num-nodes", str(args.eplb_num_nodes)]


def serve_flags(args: argparse.Namespace) -> list[str]:
    """Return the flags of `add_serve_flags` as given.

    Raises ValueError where `tool_call_flags` does, and for a negative routing balance or
    failover timeout.
    """
    if args.routing_balance < 0 or args.failover_timeout < 0:
        raise ValueError("--routing-balance and --failover-timeout must not be negative")
    return [*tool_call_flags(args),
            "--max-request-body-size", str(args.max_request_body_size),
            "--max-queued-requests", str(args.max_queued_requests),
            "--generation-config", args.generation_config,
            *["--enable-prompt-tokens-details"] * args.enable_prompt_tokens_details,
            "--routing-policy", args.routing_policy,
            "--routing-balance", str(args.routing_balance),
            "--failover-timeout", str(args.failover_timeout),
            *eplb_flags(args), *dashboard_flags(args)]


def add_tool_call_flags(p: argparse.ArgumentParser) -> None:
    """Add vLLM's flags for tool_choice "auto". Both the gateway and `serve` take them."""
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   default=env_switch("ENABLE_AUTO_TOOL_CHOICE"),
                   help="serve tool_choice \"auto\" (the default with tools), reading calls "
                        "with --tool-call-parser")
    p.add_argument("--tool-call-parser", default=env("TOOL_CALL_PARSER") or None,
                   choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls: hermes (Qwen3, Hermes), "
                        "mistral (Mixtral 8x22B: [TOOL_CALLS] and a JSON array)")


def tool_call_flags(args: argparse.Namespace) -> list[str]:
    """Return the tool-call flags as given, for a launcher to pass on.

    Raises ValueError if auto tool choice is enabled without a parser, or if the parser is
    unknown. The parser may come from the environment.
    """
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: {args.tool_call_parser!r} is not one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    return ["--enable-auto-tool-choice"] * args.enable_auto_tool_choice + \
        (["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else [])


def parse_args(argv: Sequence[str] | None = None) -> GatewayConfig:
    """Build the config from command-line flags, with defaults from `SWITCHYARD_*`."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        engines = tuple(parse_address(a) for a in args.engine.split(","))
    except ValueError as exc:
        parser.error(f"--engine: {exc}")
    if args.max_model_len is not None and args.max_model_len <= 0:
        parser.error("--max-model-len must be positive")
    service_metrics = tuple(u.strip() for u in args.service_metrics.split(",") if u.strip())
    try:
        for url in service_metrics:
            check_url(url)
    except ValueError as exc:
        parser.error(f"--service-metrics: {exc}")
    if args.max_queued_requests < 0 or args.retry_after < 0:
        parser.error("--max-queued-requests and --retry-after must not be negative")
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        parser.error(f"--model: {model_dir} is not a directory")
    try:
        sampling_defaults = SamplingDefaults.load(args.generation_config, model_dir)
    except ValueError as exc:
        parser.error(f"--generation-config: {exc}")
    try:
        serve_flags(args)
        access, tls, cors = access_settings(args, args.host)
        secret = ClusterSecret.load(args.cluster_secret_file)
    except ValueError as exc:
        parser.error(str(exc))
    return GatewayConfig(
        model_dir=model_dir,
        served_model_name=args.served_model_name or model_dir.resolve().name,
        engines=engines,
        host=args.host,
        port=args.port,
        ready_fd=args.ready_fd,
        max_model_len=args.max_model_len,
        log_level=args.log_level,
        access_log=args.access_log,
        shutdown_timeout_s=args.shutdown_timeout,
        max_request_body_bytes=args.max_request_body_size,
        max_queued_requests=args.max_queued_requests,
        retry_after_s=args.retry_after,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        service_metrics=service_metrics,
        dashboard_window_s=args.dashboard_window,
        dashboard_interval_s=args.dashboard_interval,
        otlp_ui_url=args.otlp_ui_url,
        sampling_defaults=sampling_defaults,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        routing_policy=args.routing_policy, routing_balance=args.routing_balance,
        eplb=eplb_config(args),
        failover_timeout_s=args.failover_timeout,
        access=access, tls=tls, cors=cors, secret=secret,
        link_timeout_s=args.link_timeout,
    )
