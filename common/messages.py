"""Every message that crosses a process boundary.

Frames on the wire are msgpack-encoded `Message` values, a tagged union, one per
length-prefixed frame; see `common.rpc`. Nothing else crosses a process boundary.
Every message that starts work carries a request id and a W3C trace context.

The messages are:

- `GenerateRequest`: request id, prompt token ids, `SamplingParams`, W3C trace context,
  and cache salt.
- `AbortRequest`.
- `TokenDelta`: new token ids, a finish reason, or an error.
- `InfoRequest` and `EngineInfo`, `StatsRequest` and `EngineStats`.
- Between attention and expert services, with the `rpc` backend: `ExpertBatch` and
  `ExpertResult`, which carry tensors as raw bytes with dtype and shape, and `ExpertInfo`.
- Within a DCP group: `DcpPlan`, the leader's step plan. It travels as msgpack bytes
  broadcast over the group's process group, not as a frame.
- In an `nccl` world: `NcclUniqueId`, through the rendezvous store.

Beyond these, ranks exchange only tensors in collectives, DeepEP's sizes included, and
short strings at the rendezvous: who joined, and each rank's row format.
"""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "abort", "error"]


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k <= 0, top_p >= 1 and min_p <= 0 disable those
    filters. The presence and frequency penalties follow OpenAI and apply over the
    generated tokens. The repetition penalty follows HF and vLLM and applies over prompt
    and generated tokens; 1 disables it. As in vLLM, EOS and `stop_token_ids` cannot be
    sampled before `min_tokens` generated tokens, unless EOS is ignored. A seed makes the
    request's sampled tokens reproducible whatever else is in the batch.

    `logprobs` asks for the sampled token's log-probability and the `logprobs` most likely
    alternatives at every generated position. None means no log-probabilities.
    `prompt_logprobs` asks for the same for each prompt token, given the tokens before it.
    These are vLLM's prompt logprobs, used for prompt scoring.

    `logit_bias` and `allowed_token_ids` shape what is sampled, but not the reported
    log-probabilities. `logit_bias` is OpenAI's: (token id, bias) pairs added to the
    logits. `allowed_token_ids` is vLLM's, and empty allows all tokens.
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
    grammar: str | None = None  # for structured outputs, an llguidance grammar to follow

    @property
    def biased(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


class GenerateRequest(msgspec.Struct, frozen=True, tag=True):
    """Gateway -> attention leader: start generating for one sequence.

    Only requests with the same `cache_salt`, as in vLLM, share prefix-cached KV blocks.

    `warmup` marks the gateway's readiness check. The engine makes the prompt itself and
    ignores the one given. It routes the prompt's rows to every replica of every expert,
    so one step goes through every expert rank. The warm-up's KV is never shared.

    `resumed` marks a failover's resubmission. The last `resumed` tokens of
    `prompt_token_ids` are tokens this request already generated, on an attention group
    that died. They count as its output for max_tokens, min_tokens, penalties, grammars,
    and the position each seeded draw is made at. Only the tokens after them are sent
    back.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    trace_context: dict[str, str] = {}
    cache_salt: str | None = None
    warmup: bool = False
    resumed: int = 0


class AbortRequest(msgspec.Struct, frozen=True, tag=True):
    """Gateway -> attention leader: the client went away, so free the sequence."""

    request_id: str


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Log-probabilities at one generated position, from the model's raw output
    distribution.

    As vLLM reports them, they are taken before penalties, temperature and filters.
    """

    logprob: float  # of the sampled token, or in a prompt, of the token that came next
    top_ids: list[int]  # the most likely tokens, most likely first
    top_logprobs: list[float]
    rank: int  # of that token in the vocabulary, where 1 is the most likely


class TokenDelta(msgspec.Struct, frozen=True, tag=True):
    """Attention leader -> gateway: new tokens of one sequence, and whether it ended.

    `error` is set, with finish_reason "error", when the engine rejected the request, for
    example for a prompt longer than the model's context. `retryable` marks errors that are
    the service's fault, not the request's, such as a failed expert rank. `logprobs` has
    one entry per token when the request asked for them.

    The delta with a request's first token carries more. It says how long the request
    waited to be scheduled and how long its prefill took. When asked for, it carries the
    prompt's log-probabilities: one entry per prompt token, with None for the first,
    which nothing precedes. It also says how many prompt tokens' KV came from the prefix
    cache, which is None when caching is off.
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
    """Anyone -> a service: describe yourself. Used for readiness and /v1/models."""


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
    expert_groups: int = 1  # the router's expert groups, DeepSeek's n_group; else 1
    # Which expert rank holds which experts, as the placement's JSON. Set with rpc.
    placement: str | None = None


class StatsRequest(msgspec.Struct, frozen=True, tag=True):
    """Anyone -> attention leader: report counters. Answered by `EngineStats`."""


class EngineStats(msgspec.Struct, frozen=True, tag=True):
    """Counters since the engine started.

    `expert_load[layer][expert]` counts routed token copies, so each token counts once per
    chosen expert. Dense, non-MoE layers have all-zero rows.
    """

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    num_kv_blocks: int
    num_preemptions: int
    expert_load: list[list[int]]
    num_aborted: int = 0  # requests aborted since start, because the client went away
    # Whether every layer call can be served, with ranks reachable or routed around.
    experts_ready: bool = True
    expert_services: list[str] = []  # each expert rank's state now, as in `EngineInfo`
    num_steps: int = 0  # engine steps that ran sequences
    placement_version: int = 0  # the placement the experts are routed by; see `Rebalance`


class Rebalance(msgspec.Struct, frozen=True, tag=True):
    """Gateway -> attention leader: move the experts to `placement` as version `version`.

    `placement` is the placement's JSON. The expert ranks load their shares while
    serving, then this service routes by the new placement from one step to the next.
    Answered by `Rebalanced`.
    """

    version: int
    placement: str


class PlanPlacement(msgspec.Struct, frozen=True, tag=True):
    """Gateway -> attention leader: make DeepSeek's EPLB placement of this routing load.

    `load[i][e]` counts the token copies routed to expert e of MoE layer `moe_layers[i]`.
    The placement spreads the experts over `num_ranks` expert ranks, with `num_redundant`
    extra copies per layer, and EPLB's groups and nodes as given. Answered by
    `PlacementPlan`. The attention leader makes it because the gateway has no torch.
    """

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
    """Attention leader -> gateway: routing by placement `version` since a step boundary.

    `load_s` is the expert ranks' slowest load, `prepare_s` the time until all were ready,
    and `switch_s` the switch itself. If `error` is set, the old placement still routes.
    """

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

    `x` is [N, H], grouped by the rank's local experts in ascending expert order.
    `tokens_per_expert[i]` rows belong to its i-th local expert of `layer`, in the rank's
    share of placement `version`. Version 0 is the placement the services started with;
    see `PlacementUpdate`.
    """

    call_id: int
    layer: int
    tokens_per_expert: list[int]
    x: Tensor
    trace_context: dict[str, str] = {}
    version: int = 0


class ExpertResult(msgspec.Struct, frozen=True, tag=True):
    """Expert rank -> attention rank: raw expert outputs y [N, H], or an error.

    y is row-aligned with the batch's x, and the router weights are not applied. `held_s`
    is the seconds from the batch's arrival to sending this answer, for queueing and
    compute. The caller subtracts it from the call's time to find the wire's round trip.
    """

    call_id: int
    y: Tensor | None = None
    error: str | None = None
    held_s: float = 0.0


class ExpertInfo(msgspec.Struct, frozen=True, tag=True):
    """An expert rank's answer to `InfoRequest`, saying what it holds."""

    rank: int
    num_ranks: int
    # MoE layer -> global expert ids held, in the newest placement
    experts: dict[int, list[int]]
    weight_bytes: int
    # "w4a4" means MXFP4 weights, and the rank takes MXFP4 activation rows.
    quantization: str | None = None
    # Placement version -> its `experts`, for every placement held. An old placement is
    # held until no connection uses it.
    shares: dict[int, dict[int, list[int]]] = {}


class PlacementUpdate(msgspec.Struct, frozen=True, tag=True):
    """Attention rank -> expert rank, in a rebalance: load your share of `placement`.

    `placement` is a placement's JSON from `Placement.to_json`, loaded as version
    `version` beside what the rank serves. Answered by `PlacementReady` once loaded, or at
    once if it already is.
    """

    version: int
    placement: str


class PlacementReady(msgspec.Struct, frozen=True, tag=True):
    """Expert rank -> attention rank: placement `version` is loaded, or `error` says why not.

    `experts` is this rank's share, `weight_bytes` the bytes held for it, and `load_s` the
    time it took to read.
    """

    version: int
    rank: int
    experts: dict[int, list[int]] = {}
    weight_bytes: int = 0
    load_s: float = 0.0
    error: str | None = None


class UsePlacement(msgspec.Struct, frozen=True, tag=True):
    """Attention rank -> expert rank, on a connection that sends layer calls.

    The connection's calls are laid out by placement `version` from now on. This is sent
    on connecting and on each switch. A placement older than the newest one that no
    connection uses is freed.
    """

    version: int


class DcpSeqPlan(msgspec.Struct, frozen=True, array_like=True):
    """One sequence's share of a DCP step.

    It holds the sequence's new tokens from position `start`, and its block table on every
    rank of the group.
    """

    token_ids: list[int]
    start: int
    shard_tables: list[list[int]]


class DcpPlan(msgspec.Struct, frozen=True, tag=True):
    """DCP leader -> its peers, every step: the sequences to run, in batch order.

    - `stop` ends the peers.
    - `micro_batches` says how many sequences each micro-batch of a pipelined step takes,
      in order. Empty means one batch.
    - `heartbeat` means no step: the leader is idle. It is sent every
      `dcp.group.HEARTBEAT_S`, and every rank answers. This way a silent link is found on
      both ends within the group's collective timeout.
    - `mtp_source` means not a step but a pass of the MTP layer, speculative decoding's
      drafter, over `seqs`, predicting each position's next token. Its input hidden
      states are rows `mtp_rows` of the last step's output ("step") or of the last MTP
      pass's output ("pass"). Every rank holds both.
    """

    seqs: list[DcpSeqPlan]
    stop: bool = False
    micro_batches: list[int] = msgspec.field(default_factory=list)
    heartbeat: bool = False
    mtp_source: str = ""
    mtp_rows: list[int] = msgspec.field(default_factory=list)


class NcclUniqueId(msgspec.Struct, frozen=True):
    """Attention rank 0 -> every rank of an `nccl` world, through the rendezvous store.

    It carries NCCL's 128-byte communicator id, in the type this CuPy gave it. With
    `as_bytes`, that is CuPy 14's bytes. Otherwise it is CuPy 13's tuple of signed chars.
    """

    id: list[int]
    as_bytes: bool


Message = (
    GenerateRequest | AbortRequest | TokenDelta | InfoRequest | EngineInfo | StatsRequest
    | EngineStats | ExpertBatch | ExpertResult | ExpertInfo | DcpPlan | Rebalance | Rebalanced
    | PlacementUpdate | PlacementReady | UsePlacement | PlanPlacement | PlacementPlan
)
