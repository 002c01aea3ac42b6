"""Every message that crosses a process boundary.

Frames on the wire are msgpack-encoded `Message` values (a tagged union), one per
length-prefixed frame (see `common.rpc`). Nothing else crosses a process boundary.
Every message that starts work carries a request id and a W3C trace context.
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k <= 0, top_p >= 1 and min_p <= 0 disable those
    filters. Penalties follow OpenAI (presence, frequency: over the generated tokens) and
    HF/vLLM (repetition: over prompt and generated tokens; 1 disables it). Before
    `min_tokens` generated tokens, EOS (unless ignored) and `stop_token_ids` cannot be
    sampled (vLLM). A seed makes the
    request's sampled tokens reproducible whatever else is in the batch. `logprobs` asks
    for the sampled token's log-probability and the `logprobs` most likely alternatives at
    every generated position (None: no log-probabilities); `prompt_logprobs` the same for
    each prompt token given those before it (vLLM's prompt logprobs: prompt scoring).
    `logit_bias` (OpenAI: (token id, bias) pairs added to the logits) and
    `allowed_token_ids` (vLLM: empty allows all) shape what is sampled, not the reported
    log-probabilities.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    grammar: str | None = None  # structured outputs: an llguidance grammar to follow

    @property
    def biased(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


class GenerateRequest(msgspec.Struct, frozen=True, tag=True):
    """Gateway -> attention leader: start generating for one sequence. Only requests of
    the same `cache_salt` (vLLM's) share prefix-cached KV blocks.

    `warmup`: the gateway's readiness check. The engine makes the prompt itself (the one
    given is ignored) and routes its rows to every replica of every expert, so one step
    goes through every expert rank; its KV is never shared.

    `resumed`: a failover's resubmission. The last `resumed` of `prompt_token_ids` are
    tokens this request already generated (on an attention group that died): they count
    as its output (max_tokens, min_tokens, penalties, grammars, and the position each
    seeded draw is made at), and only the tokens after them are sent back."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    trace_context: dict[str, str] = {}
    cache_salt: str | None = None
    warmup: bool = False
    resumed: int = 0


class AbortRequest(msgspec.Struct, frozen=True, tag=True):
    """Gateway -> attention leader: the client went away; free the sequence."""

    request_id: str


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Log-probabilities at one generated position, of the model's raw output
    distribution (before penalties, temperature and filters, as vLLM reports them)."""

    logprob: float  # of the token that was sampled (or, in a prompt, that came next)
    top_ids: list[int]  # the most likely tokens, most likely first
    top_logprobs: list[float]
    rank: int  # of that token among the vocabulary, from 1 (the most likely)


class TokenDelta(msgspec.Struct, frozen=True, tag=True):
    """Attention leader -> gateway: new tokens of one sequence, and whether it ended.

    `error` is set (with finish_reason "error") when the engine rejected the request,
    e.g. a prompt longer than the model's context; `retryable` marks errors that are the
    service's fault, not the request's (an expert rank failed). `logprobs` has one entry
    per token when
    the request asked for them. The delta with a request's first token carries how long it
    waited to be scheduled and how long its prefill took, and, when asked for, the prompt's
    log-probabilities: one entry per prompt token, None for the first (nothing precedes it),
    and how many prompt tokens' KV came from the prefix cache (None: caching off).
    """

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    error: str | None = None
    retryable: bool = False
    logprobs: list[TokenLogprobs] | None = None
    queue_time_s: float | None = None
    prefill_time_s: float | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int | None = None


class InfoRequest(msgspec.Struct, frozen=True, tag=True):
    """Anyone -> a service: describe yourself (used for readiness and /v1/models)."""


class EngineInfo(msgspec.Struct, frozen=True, tag=True):
    """Attention leader's answer to `InfoRequest`."""

    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int = 1  # sequences one step runs at most
    quantization: str | None = None  # "w4a4" when the experts and their inputs are MXFP4
    dense_quantization: str | None = None  # "int8" when the dense linears are 8-bit
    dispatch_backend: str = "local"
    expert_services: list[str] = []  # one line per expert rank, for /health
    moe_layers: list[int] = []  # decoder layers with routed experts
    num_experts: int = 0  # routed experts per MoE layer
    expert_groups: int = 1  # the router's expert groups (DeepSeek's n_group), else 1
    placement: str | None = None  # which expert rank holds which experts (its JSON; rpc)


class StatsRequest(msgspec.Struct, frozen=True, tag=True):
    """Anyone -> attention leader: report counters (answered by `EngineStats`)."""


class EngineStats(msgspec.Struct, frozen=True, tag=True):
    """Counters since the engine started.

    `expert_load[layer][expert]` counts routed token copies (each token counts once per
    chosen expert); dense (non-MoE) layers have all-zero rows.
    """

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    num_kv_blocks: int
    num_preemptions: int
    expert_load: list[list[int]]
    num_aborted: int = 0  # requests aborted (client gone) since start
    experts_ready: bool = True  # every layer call can be served (ranks reachable or routed
    # around)
    expert_services: list[str] = []  # each expert rank's state now (`EngineInfo`'s lines)
    num_steps: int = 0  # engine steps that ran sequences
    placement_version: int = 0  # the placement the experts are routed by (`Rebalance`)


class Rebalance(msgspec.Struct, frozen=True, tag=True):
    """Gateway -> attention leader: move the experts to `placement` (its JSON) as version
    `version`: the expert ranks load their shares while serving, then this service
    routes by it from one step to the next. Answered by `Rebalanced`."""

    version: int
    placement: str


class PlanPlacement(msgspec.Struct, frozen=True, tag=True):
    """Gateway -> attention leader: DeepSeek's EPLB placement of this routing load
    (`load[i][e]`: token copies routed to expert e of MoE layer `moe_layers[i]`) over
    `num_ranks` expert ranks, with `num_redundant` extra copies a layer (EPLB's groups
    and nodes as given). Answered by `PlacementPlan`; the gateway has no torch."""

    load: list[list[int]]
    moe_layers: list[int]
    num_ranks: int
    num_redundant: int = 0
    num_groups: int = 1
    num_nodes: int = 1


class PlacementPlan(msgspec.Struct, frozen=True, tag=True):
    """Attention leader -> gateway: the placement's JSON, or why there is none."""

    placement: str | None = None
    error: str | None = None


class Rebalanced(msgspec.Struct, frozen=True, tag=True):
    """Attention leader -> gateway: routing by placement `version` since a step boundary
    (`load_s`: the expert ranks' slowest load, `prepare_s` until all were ready, `switch_s`
    the switch itself), or `error` (the old placement still routes)."""

    version: int
    load_s: float = 0.0
    prepare_s: float = 0.0
    switch_s: float = 0.0
    error: str | None = None


class Tensor(msgspec.Struct, frozen=True):
    """A dense tensor on the wire: raw little-endian bytes, dtype name, shape."""

    data: bytes
    dtype: str
    shape: list[int]


class ExpertBatch(msgspec.Struct, frozen=True, tag=True):
    """Attention rank -> expert rank: the rows of one MoE layer call routed to this rank.

    `x` is [N, H], grouped by the rank's local experts in ascending expert order;
    `tokens_per_expert[i]` rows belong to its i-th local expert of `layer`, in the share
    of placement `version` (0: the one the services started with; `PlacementUpdate`).
    """

    call_id: int
    layer: int
    tokens_per_expert: list[int]
    x: Tensor
    trace_context: dict[str, str] = {}
    version: int = 0


class ExpertResult(msgspec.Struct, frozen=True, tag=True):
    """Expert rank -> attention rank: raw expert outputs y [N, H], row-aligned with the
    batch's x (router weights not applied), or an error; `held_s`: seconds from the
    batch's arrival to this answer's sending (queue and compute), which the caller takes
    from the call's time to find the wire's round trip."""

    call_id: int
    y: Tensor | None = None
    error: str | None = None
    held_s: float = 0.0


class ExpertInfo(msgspec.Struct, frozen=True, tag=True):
    """An expert rank's answer to `InfoRequest`: what it holds."""

    rank: int
    num_ranks: int
    experts: dict[int, list[int]]  # MoE layer -> global expert ids held (newest placement)
    weight_bytes: int
    quantization: str | None = None  # "w4a4": MXFP4 weights, takes MXFP4 activation rows
    shares: dict[int, dict[int, list[int]]] = {}  # placement version -> its `experts`, for
    # every placement held (an old one until no connection uses it)


class PlacementUpdate(msgspec.Struct, frozen=True, tag=True):
    """Attention rank -> expert rank (a rebalance): load your share of `placement` (a
    placement's JSON, `Placement.to_json`) as version `version`, beside what you serve.
    Answered by `PlacementReady` once loaded (at once if it already is)."""

    version: int
    placement: str


class PlacementReady(msgspec.Struct, frozen=True, tag=True):
    """Expert rank -> attention rank: placement `version` is loaded (`experts`: this
    rank's share, `weight_bytes` held for it, `load_s` to read it), or `error`."""

    version: int
    rank: int
    experts: dict[int, list[int]] = {}
    weight_bytes: int = 0
    load_s: float = 0.0
    error: str | None = None


class UsePlacement(msgspec.Struct, frozen=True, tag=True):
    """Attention rank -> expert rank, on a connection that sends layer calls: its calls
    are laid out by placement `version` from now on (sent on connecting and on each
    switch). A placement older than the newest that no connection uses is freed."""

    version: int


class DcpSeqPlan(msgspec.Struct, frozen=True, array_like=True):
    """One sequence's share of a DCP step: its new tokens from position `start`, and its
    block table on every rank of the group."""

    token_ids: list[int]
    start: int
    shard_tables: list[list[int]]


class DcpPlan(msgspec.Struct, frozen=True, tag=True):
    """DCP leader -> its peers, every step: the sequences to run, in batch order (`stop`
    ends the peers); `micro_batches`: how many of them each micro-batch of a pipelined
    step takes, in order (empty: one batch). `heartbeat`: no step, the leader is idle
    (every `dcp.group.HEARTBEAT_S`) and every rank answers, so that a silent link is
    found on both ends within the group's collective timeout. `mtp_source`: not a step
    but a pass of the MTP layer (speculative decoding's drafter) over `seqs` (each
    position's next token), its input hidden states rows `mtp_rows` of the last step's
    output ("step") or of the last MTP pass's ("pass"): every rank holds both."""

    seqs: list[DcpSeqPlan]
    stop: bool = False
    micro_batches: list[int] = msgspec.field(default_factory=list)
    heartbeat: bool = False
    mtp_source: str = ""
    mtp_rows: list[int] = msgspec.field(default_factory=list)


class NcclUniqueId(msgspec.Struct, frozen=True):
    """Attention rank 0 -> every rank of an `nccl` world, through the rendezvous store:
    NCCL's 128-byte communicator id, in the type this CuPy gave it (`as_bytes`: CuPy 14's
    bytes; else CuPy 13's tuple of signed chars)."""

    id: list[int]
    as_bytes: bool


Message = (
    GenerateRequest | AbortRequest | TokenDelta | InfoRequest | EngineInfo | StatsRequest
    | EngineStats | ExpertBatch | ExpertResult | ExpertInfo | DcpPlan | Rebalance | Rebalanced
    | PlacementUpdate | PlacementReady | UsePlacement | PlanPlacement | PlacementPlan
)
