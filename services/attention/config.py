"""AttentionConfig: the attention service's settings, built once from flags and environment."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.auth import NO_SECRET, ClusterSecret, add_secret_flag
from common.device import resolve_dtype
from common.flags import (
    add_device_flag,
    add_link_timeout_flag,
    add_metrics_flag,
    add_quantization_flag,
    add_rendezvous_flag,
    add_replicas_flag,
    env,
    env_switch,
    optional_int,
)
from common.rpc import LINK_TIMEOUT_S
from common.units import parse_size
from ep_dispatch.deepep_config import DeepEPSettings, add_deepep_flags, deepep_settings
from ep_dispatch.registry import backend as dispatch_backend
from services.attention.micro_batches import PIPELINE_MIN_TOKENS, WIRE_SHARE
from services.attention.spec_decode.config import SpeculativeConfig, parse_speculative_config
from services.model.config import DENSE_QUANTIZATIONS

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class AttentionConfig:
    model: Path
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    enable_prefix_caching: bool = True  # share the KV of equal prompt prefixes, as vLLM does
    kv_cache_memory: int = 1 << 30  # bytes for the paged KV cache
    max_num_batched_tokens: int = 512  # per-step token budget (prefill chunk size)
    max_num_seqs: int = 128
    max_model_len: int | None = None
    dispatch_backend: str = "local"
    expert_addresses: tuple[tuple[str, int], ...] = ()
    placement: Path | None = None
    expert_replicas: int = 1  # without a placement file: each expert on this many ranks
    expert_timeout: float = 30.0
    link_timeout: float = LINK_TIMEOUT_S  # a peer silent this long is dead (`set_liveness`)
    rendezvous_timeout: float = 300.0  # lockstep worlds and DCP groups: for every rank
    dist_init: tuple[str, int] | None = None  # torch backend: the rendezvous (TCP store)
    attention_rank: int = 0
    attention_ranks: int = 1
    expert_ranks: int = 0
    num_threads: int | None = None
    host: str = "127.0.0.1"
    port: int = 0
    ready_fd: int | None = None
    quantization: str = "auto"  # auto (the checkpoint's), none or w4a4
    dense_quantization: str = "auto"  # auto (the checkpoint's), none or int8
    dcp_size: int = 1  # ranks of this attention group sharing each sequence's KV
    dcp_rank: int = 0  # 0: the leader (scheduler, gateway connection, experts)
    dcp_interleave: int = 1  # consecutive tokens per rank
    dcp_init: tuple[str, int] | None = None  # the group's rendezvous, hosted by rank 0
    otlp_traces_endpoint: str | None = None
    metrics_port: int | None = None  # Prometheus /metrics; None: not served
    deepep: DeepEPSettings = field(default_factory=DeepEPSettings)
    cuda_graph_max_batch: int = 0  # decode steps of up to this many sequences replay graphs
    cuda_graph_max_len: int = 4096  # ... whose longest has up to this many keys
    micro_batches: str = "auto"  # auto, 1, 2 or 3: a step's ping-pong micro-batches
    speculative: SpeculativeConfig | None = None  # --speculative-config
    secret: ClusterSecret = NO_SECRET  # what connections in and out prove (`common.auth`)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.device)


def check_cuda_graphs(max_batch: int, max_len: int, device: str, backend: str,
                      dcp_size: int) -> None:
    """Decode graphs capture the whole step, experts included, so they need in-process
    experts.

    Raises:
        ValueError: graphs asked for where they cannot run; the message names the flags.
    """
    if max_batch < 0 or max_len < 1:
        raise ValueError("--cuda-graph-max-batch must be >= 0 and --cuda-graph-max-len >= 1")
    if not max_batch:
        return
    if device != "cuda":
        raise ValueError("--cuda-graph-max-batch needs --device cuda")
    if not dispatch_backend(backend).in_process or dcp_size > 1:
        raise ValueError("--cuda-graph-max-batch captures the experts inside the step: it "
                         "needs --dispatch-backend local and no DCP (the other backends and "
                         "DCP cross processes within a step)")


def parse_addresses(text: str) -> list[tuple[str, int]]:
    """'h1:p1,h2:p2' -> [(h1, p1), (h2, p2)]."""
    from common.rpc import parse_address

    return [parse_address(a) for a in text.split(",") if a.strip()]


def _speculative(text: str) -> str:
    """The flag's JSON, checked (argparse names the field that is wrong, at start-up)."""
    try:
        parse_speculative_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--speculative-config: ")) \
            from None
    return text


def add_engine_flags(p: argparse.ArgumentParser, default_backend: str = "local"
                     ) -> list[argparse.Action]:
    """Flags shared by `switchyard attention` and `switchyard serve`. They are returned,
    so that `serve` forwards every one of them (`common.flags.as_flags`)."""
    add = p.add_argument
    return [
        add("--dtype", default=env("DTYPE", "auto"),
            help="compute dtype: auto (float32 on CPU, where bfloat16 matmuls are ~100x "
                 "slower without AVX-512 BF16; bfloat16 on GPU), float32, bfloat16, float16"),
        add_device_flag(p),
        add("--block-size", type=int, default=int(env("BLOCK_SIZE", "16")),
            help="tokens per KV-cache block"),
        add("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
            default=env_switch("ENABLE_PREFIX_CACHING", True),
            help="keep the KV of full blocks and reuse it for later requests that start "
                 "with the same tokens (vLLM's automatic prefix caching; default: on)"),
        add("--kv-cache-memory", type=parse_size,
            default=parse_size(env("KV_CACHE_MEMORY", "1GiB")),
            help="memory budget of the paged KV cache (e.g. 512MiB, 2GiB)"),
        add("--max-num-batched-tokens", type=int,
            default=int(env("MAX_NUM_BATCHED_TOKENS", "512")),
            help="token budget of one scheduler step; longer prompts are chunked"),
        add("--max-num-seqs", type=int, default=int(env("MAX_NUM_SEQS", "128")),
            help="most sequences running at once (at most the token budget)"),
        add("--max-model-len", type=int, default=optional_int(env("MAX_MODEL_LEN")),
            help="context limit (default: the model's, capped by the KV cache)"),
        add("--cuda-graph-max-batch", type=int, default=int(env("CUDA_GRAPH_MAX_BATCH", "0")),
            help="replay CUDA graphs for decode steps of up to this many sequences "
                 "(--device cuda, local backend; one graph per power-of-two count of "
                 "sequences and of keys, all captured at start-up; 0: off)"),
        add("--cuda-graph-max-len", type=int, default=int(env("CUDA_GRAPH_MAX_LEN", "4096")),
            help="... when no sequence has more keys than this (longer steps run eagerly: a "
                 "graph attends over its whole padded length)"),
        add("--speculative-config", type=_speculative, default=env("SPECULATIVE_CONFIG"),
            help="speculative decoding, as a JSON object (vLLM's): "
                 "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3, "
                 "\"prompt_lookup_min\": 1, \"prompt_lookup_max\": 3}' drafts up to 3 "
                 "tokens a step from the sequence's own earlier tokens; "
                 "disable_by_batch_size: no drafts in steps of more sequences. Greedy "
                 "requests without penalties, biases, grammars or logprobs speculate; the "
                 "others decode as before"),
        add("--micro-batches", choices=["auto", "1", "2", "3"],
            default=env("MICRO_BATCHES", "auto"),
            help="split each step into this many micro-batches and pipeline them with the "
                 "expert services (ping-pong: one's attention while the experts compute "
                 "another's layer; rpc and torch backends, DCP groups too); auto: measured "
                 "for each size of step, where the wire's round trips are at least "
                 f"{100 * WIRE_SHARE:.0f}%% of a step (or from {PIPELINE_MIN_TOKENS} tokens on a "
                 "GPU): 1, 2 and 3 each timed, the fastest kept and logged"),
        add("--dispatch-backend", default=env("DISPATCH_BACKEND", default_backend),
            help="ep_dispatch backend between attention and experts: local (experts in the "
                 "attention process), rpc (expert services over TCP), torch "
                 "(torch.distributed all-to-all: gloo, or NCCL with --device cuda), nccl "
                 "(NCCL through CuPy, --device cuda) or deepep (DeepEP's kernels, --device "
                 "cuda)"),
        add("--placement", "--expert-placement", default=env("PLACEMENT"),
            help="placement JSON file (default: balanced round-robin); `switchyard "
                 "placement --load URL` makes one from measured load (DeepSeek's EPLB)"),
        add_replicas_flag(p),
        add("--expert-timeout", type=float, default=float(env("EXPERT_TIMEOUT", "30")),
            help="seconds an expert rank may take to answer one layer call, or to accept "
                 "the connection at start-up"),
        add_quantization_flag(p, "w4a4: experts as MXFP4 (quantized at load unless the "
                                 "checkpoint already is, see `switchyard quantize`), "
                                 "activations dispatched as MXFP4 (every backend but deepep)"),
        add("--dense-quantization", default=env("DENSE_QUANTIZATION") or "auto",
            choices=DENSE_QUANTIZATIONS,
            help="the dense linears (attention projections, shared experts, dense MLPs, "
                 "lm_head): auto (default): the checkpoint's; none: the model's dtype; "
                 "int8: 8-bit weights with a scale per output channel (on the CPU int8, "
                 "widened in registers; on a GPU FP8 by torch._scaled_mm), quantized at "
                 "load unless the checkpoint already is (`switchyard quantize --dense "
                 "int8`)"),
        add_rendezvous_flag(p),
        add("--dcp-size", type=int, default=int(env("DCP_SIZE", "1")),
            help="decode context parallelism: ranks per attention group, each holding 1/D "
                 "of every sequence's KV cache"),
        add("--dcp-interleave", type=int, default=int(env("DCP_INTERLEAVE", "1")),
            help="consecutive tokens stored on one DCP rank before the next"),
        add("--num-threads", type=int, default=optional_int(env("NUM_THREADS")),
            help="torch intra-op threads (default: torch's choice)"),
        add("--otlp-traces-endpoint", default=env("OTLP_TRACES_ENDPOINT"),
            help="OTLP traces URL (or set the OTEL_EXPORTER_OTLP_* variables)"),
        add("--dist-init", default=env("DIST_INIT"),
            help="torch backend: HOST:PORT of the rendezvous, hosted by attention rank 0"),
        *add_deepep_flags(p),
    ]


def add_attention_parser(sub: argparse._SubParsersAction) -> None:
    """`switchyard attention`: the engine flags, and those of one process of a deployment:
    its address, its expert ranks, its place in a world or a DCP group."""
    p = sub.add_parser("attention", help="run one attention service (the engine core)")
    p.add_argument("--model", default=env("MODEL"), required=env("MODEL") is None,
                   help="HF checkpoint directory")
    p.add_argument("--host", default=env("ATTENTION_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("ATTENTION_PORT", "0")),
                   help="RPC port (0 picks a free one)")
    p.add_argument("--ready-fd", type=int, default=None,
                   help="write the bound port to this file descriptor once listening")
    p.add_argument("--expert-addresses", default=env("EXPERT_ADDRESSES"),
                   help="rpc backend: HOST:PORT of each expert rank, comma-separated, in "
                        "rank order")
    p.add_argument("--attention-rank", type=int, default=int(env("ATTENTION_RANK", "0")),
                   help="this attention group's index, 0..attention-ranks-1: its name on the "
                        "dashboard, and the torch backend's rank")
    p.add_argument("--attention-ranks", type=int, default=int(env("ATTENTION_RANKS", "1")),
                   help="torch backend: number of attention groups in the world")
    p.add_argument("--expert-ranks", type=int, default=int(env("EXPERT_RANKS", "0")),
                   help="torch backend: number of expert ranks in the world")
    p.add_argument("--dcp-rank", type=int, default=int(env("DCP_RANK", "0")),
                   help="this process's rank in its DCP group (0: the leader, which the "
                        "gateway connects to)")
    p.add_argument("--dcp-init", default=env("DCP_INIT"),
                   help="HOST:PORT of the DCP group's rendezvous, hosted by its rank 0")
    add_engine_flags(p)
    add_link_timeout_flag(p)
    add_metrics_flag(p)
    add_secret_flag(p)


def from_args(args: argparse.Namespace) -> AttentionConfig:
    return AttentionConfig(
        model=Path(args.model), dtype=args.dtype, device=args.device,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        dispatch_backend=args.dispatch_backend, num_threads=args.num_threads,
        micro_batches=args.micro_batches,
        speculative=parse_speculative_config(args.speculative_config),
        expert_addresses=tuple(parse_addresses(getattr(args, "expert_addresses", None) or "")),
        placement=Path(args.placement) if args.placement else None,
        expert_replicas=args.expert_replicas,
        expert_timeout=args.expert_timeout, rendezvous_timeout=args.rendezvous_timeout,
        link_timeout=getattr(args, "link_timeout", 5.0),
        dist_init=parse_addresses(args.dist_init)[0] if args.dist_init else None,
        attention_rank=getattr(args, "attention_rank", 0),
        attention_ranks=getattr(args, "attention_ranks", 1),
        expert_ranks=getattr(args, "expert_ranks", 0),
        host=getattr(args, "host", "127.0.0.1"), port=getattr(args, "port", 0),
        ready_fd=getattr(args, "ready_fd", None),
        quantization=args.quantization, dense_quantization=args.dense_quantization,
        dcp_size=args.dcp_size, dcp_interleave=args.dcp_interleave,
        dcp_rank=getattr(args, "dcp_rank", 0),
        dcp_init=parse_addresses(args.dcp_init)[0] if getattr(args, "dcp_init", None) else None,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        metrics_port=getattr(args, "metrics_port", None),
        deepep=deepep_settings(args),
        cuda_graph_max_batch=args.cuda_graph_max_batch,
        cuda_graph_max_len=args.cuda_graph_max_len,
        secret=ClusterSecret.load(getattr(args, "cluster_secret_file", None)),
    )
