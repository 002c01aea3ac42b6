"""The engine core of an attention service: requests in, token deltas out, one step at a
time. The `ModelRunner` in `runner.py` runs the model over a step.

`Engine.step` is the hot loop. Each step goes as follows.

1. The scheduler in `scheduler.py` picks the step's chunks.
2. The runner plans the step with `batch.py`, then with the attention strategy's batch.
   It runs `DenseModel.forward` and takes logits only for the rows that sample. For
   requests that ask for prompt logprobs, it also takes the prompt rows of their chunks.
3. `sampler.py` draws the tokens.
4. The spans whose every token's KV is now computed join the prefix cache.
5. The stop conditions are checked: EOS unless `ignore_eos`, `stop_token_ids`,
   `max_tokens`, and the context limit. Finished sequences return their blocks at once.

Prompt logprobs are vLLM's `prompt_logprobs`, and `echo` with `logprobs`. `_score_prompts`
scores them as the prompt's chunks run. The rows already computed go through `lm_head` in
slices of at most 2^25 logits, once per position even after a preemption. The scores are
sent with the first token.

A step that raises fails only the sequences it ran, with `StepFailed`. The waiting and
unscheduled sequences go on. The error deltas become a retryable 503 at the gateway. They
carry the root causes from `common.failures`, and the engine logs the traceback once. Some
requests are refused alone rather than failed with their batch: those whose `add` raises,
and those whose sampling parameters would make `sample()` raise. Such parameters are stop
ids or logprobs beyond the vocabulary, and values outside vLLM's ranges.

Some ranks run in lockstep with peers: those of the `torch`, `nccl` and `deepep` backends,
and those of a DCP group. If a step fails on such a rank, for example because a DCP peer
died, the rank is out of step. It answers none of its requests, and the service exits with
status 3. Its peers wait in collectives that it will never join, and only a new world can
pair up again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from itertools import accumulate

import msgspec
import torch
from prometheus_client import Histogram

from common import tracing
from common.failures import root_causes
from common.messages import (
    EngineInfo,
    EngineStats,
    GenerateRequest,
    SamplingParams,
    TokenDelta,
    TokenLogprobs,
)
from ep_dispatch.base import Movable
from services.attention.block_manager import BlockManager
from services.attention.config import AttentionConfig
from services.attention.grammar import Grammars
from services.attention.runner import ModelRunner
from services.attention.sampler import sample, sampling_error, token_logprobs
from services.attention.scheduler import ScheduledSeq, Scheduler
from services.attention.sequence import Sequence
from services.attention.spec_decode.mtp import MtpProposer, MtpWeights, Settled
from services.attention.spec_decode.speculator import Speculator
from services.attention.tracing import step_span, trace_request
from services.attention.warmup import warmup_prompt
from services.model.config import ModelConfig

log = logging.getLogger(__name__)
# The served TPOT minus this time is the serving overhead, as benchmarks.serving measures
# it. This is the step's own time, including its exchanges with expert services, and none
# of the server around it.
_STEP_SECONDS = Histogram(
    "switchyard:engine_step_seconds",
    "One engine step with sequences scheduled (forward, exchanges, sampling, drafting); "
    "decode: every sequence one new token (and its drafts), prefill: any prompt chunk.",
    ["kind"],
    buckets=(1e-3, 2.5e-3, 5e-3, 1e-2, 2e-2, 3e-2, 5e-2, 7.5e-2, 0.1, 0.15, 0.25, 0.5, 1.0,
             2.5, 5.0))
_STEP_KINDS = {True: _STEP_SECONDS.labels("decode"), False: _STEP_SECONDS.labels("prefill")}


class StepFailed(RuntimeError):
    """A step raised the exception in `__cause__`.

    The sequences it ran, `request_ids`, are to be failed with this error's text, which
    holds the cause's root causes. The other sequences were not touched.
    """

    def __init__(self, cause: Exception, request_ids: list[str]) -> None:
        super().__init__(root_causes(cause))
        self.request_ids = request_ids


@dataclass(frozen=True)
class EngineParts:
    """What `build_engine` makes of a config: the pieces an `Engine` steps over.

    `runner` runs the model over a step.
    """

    config: AttentionConfig
    model_config: ModelConfig
    device: str
    dtype: torch.dtype
    quantization: str | None
    runner: ModelRunner
    block_manager: BlockManager
    scheduler: Scheduler
    grammars: Grammars
    max_model_len: int
    mtp: MtpWeights | None = None  # the checkpoint's MTP layer, if it drafts


class Engine:
    """Continuous-batching generation over a paged KV cache.

    Not thread-safe: the service calls `add`, `abort` and `step` from one thread at a time.
    `builder.build_engine` builds it from a config, including the checks and wiring.
    """

    def __init__(self, parts: EngineParts) -> None:
        self.config, self.model_config = parts.config, parts.model_config
        self.device, self.dtype, self.quantization = parts.device, parts.dtype, parts.quantization
        self.runner = parts.runner
        self.block_manager, self.scheduler = parts.block_manager, parts.scheduler
        self.grammars, self.max_model_len = parts.grammars, parts.max_model_len
        self._seqs: dict[str, Sequence] = {}
        self.num_aborted = 0
        self.num_steps = 0  # steps that ran sequences; a rebalance's window counts them
        self._accepted = 0  # drafts accepted by the step's verification, for its span
        self._stepping = threading.Lock()  # held by a step, and close() waits for it
        # Once closed, a step does nothing. Such a step is a worker thread that started late.
        self._closed = False
        spec, mtp = parts.config.speculative, parts.mtp
        self.speculator = Speculator(spec, self.max_model_len, MtpProposer(
            mtp, self.runner, self.block_manager) if mtp else None) if spec else None

    def close(self, timeout: float = 30.0) -> None:
        """Leave the experts and the DCP group.

        This waits until a step that another thread still runs has ended. A service
        cancelled on a signal abandons its step's thread. Closing under that step would
        pair its exchanges with the stop message.
        """
        idle = self._stepping.acquire(timeout=timeout)
        if not idle:
            log.warning("closing under a step that did not end within %.0f s", timeout)
        try:
            self._closed = True
            self.runner.close()
        finally:
            if idle:
                self._stepping.release()

    def heartbeat(self) -> None:
        """Send the attention strategy's heartbeat while idle between steps.

        For a DCP leader, this is its heartbeat to its peers. Raises if a peer is gone.
        """
        with self._stepping:
            if not self._closed:
                self.runner.attention.heartbeat()

    def info(self) -> EngineInfo:
        cfg, experts = self.model_config, self.runner.experts
        return EngineInfo(
            architecture=cfg.architecture, max_model_len=self.max_model_len,
            vocab_size=cfg.vocab_size, eos_token_ids=cfg.eos_token_ids,
            dtype=str(self.dtype).removeprefix("torch."),
            num_kv_blocks=self.block_manager.num_blocks, block_size=self.block_manager.block_size,
            max_num_seqs=self.scheduler.max_num_seqs, quantization=self.quantization,
            dense_quantization=self.runner.model.dense_quantization,
            dispatch_backend=self.config.dispatch_backend,
            expert_services=self.runner.experts.describe(),
            moe_layers=self.runner.moe_layers,
            num_experts=cfg.num_experts,
            expert_groups=cfg.routing_spec.n_group if cfg.routing_spec.method != "greedy"
            else 1,
            placement=experts.placement_json if isinstance(experts, Movable) else None,
        )

    def stats(self) -> EngineStats:
        bm, experts = self.block_manager, self.runner.experts
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=bm.num_blocks - bm.num_free_blocks, num_kv_blocks=bm.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            expert_load=self.runner.model.expert_load.tolist(), num_aborted=self.num_aborted,
            experts_ready=experts.ready(), expert_services=experts.describe(),
            num_steps=self.num_steps,
            placement_version=experts.placement_version if isinstance(experts, Movable)
            else 0,
        )

    def prepare_placement(self, version: int, placement_json: str) -> float:
        """Have the expert ranks load their shares of a rebalance's placement.

        This blocks, and runs on any thread but the step's. Returns the slowest rank's
        seconds. Raises ValueError where the dispatch backend cannot move experts while
        serving.
        """
        return self.runner.movable().prepare(version, placement_json)

    def switch_placement(self, version: int) -> None:
        """Route by the prepared placement `version` from the next step on.

        This runs between steps, on the step thread.
        """
        self.runner.switch_placement(version)

    def add(self, request: GenerateRequest) -> TokenDelta | None:
        """Queue a request. Returns an error delta instead when it cannot be served."""
        if request.warmup:  # its own prompt, and KV blocks that no other request finds
            prompt = warmup_prompt(self.model_config, self.runner.warmup_replicas,
                                   self.max_model_len)
            request = msgspec.structs.replace(request, prompt_token_ids=prompt,
                                              cache_salt=f"warm-up {os.urandom(16).hex()}")
        error, matcher = self._validate(request), None
        if error is None and request.sampling.grammar is not None:
            matcher, error = self.grammars.matcher(request.sampling.grammar)
            resumed = request.prompt_token_ids[len(request.prompt_token_ids)
                                               - request.resumed:]
            if matcher is not None and not all(map(matcher.consume_token, resumed)):
                error = "structured outputs: the resumed tokens do not follow the grammar"
        if error:
            return TokenDelta(request.request_id, [], "error",
                              len(request.prompt_token_ids) - request.resumed, error)
        seq = Sequence(request.request_id, list(request.prompt_token_ids),
                       len(request.prompt_token_ids) - request.resumed, request.sampling,
                       torch.Generator(self.device),
                       trace_parent=tracing.sampled_span(request.trace_context),
                       matcher=matcher, cache_salt=request.cache_salt,
                       warmup=request.warmup)
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return None

    def _validate(self, request: GenerateRequest) -> str | None:
        vocab, resumed = self.model_config.vocab_size, request.resumed
        n = len(request.prompt_token_ids) - resumed  # the prompt's own tokens
        if request.request_id in self._seqs:
            return f"request id {request.request_id!r} is already running"
        if not 0 <= resumed < request.sampling.max_tokens:
            return "resumed must be at least 0 and less than max_tokens"
        if n <= 0:
            return "the prompt is empty"
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            return f"prompt token ids must be in [0, {vocab})"
        if request.sampling.max_tokens < 1:
            return "max_tokens must be at least 1"
        if not 0 <= request.sampling.min_tokens <= request.sampling.max_tokens:
            return "min_tokens must be between 0 and max_tokens"
        if error := sampling_error(request.sampling, vocab):
            return error
        # Resumed tokens count in max_tokens, so n excludes them.
        if n + request.sampling.max_tokens > self.max_model_len:
            return (f"this model's maximum context length is {self.max_model_len} tokens; "
                    f"the request has {n} prompt tokens and asks for "
                    f"{request.sampling.max_tokens} more")
        return None

    def abort(self, request_id: str) -> TokenDelta | None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        self.num_aborted += 1
        trace_request(seq, "abort")
        return TokenDelta(request_id, [], "abort", seq.num_prompt_tokens)

    def fail(self, request_ids: list[str], error: str) -> list[TokenDelta]:
        """End these sequences with an error because a step they were in failed.

        Their blocks are returned. Ids that are no longer running are skipped.
        """
        deltas = []
        for request_id in request_ids:
            if (seq := self._seqs.pop(request_id, None)) is None:
                continue
            self.scheduler.finish(seq)
            trace_request(seq, "error")
            deltas.append(TokenDelta(request_id, [], "error", seq.num_prompt_tokens, error,
                                     retryable=True))
        return deltas

    def fail_all(self, error: str) -> list[TokenDelta]:
        """End every sequence with an error, after a failure that may have touched any."""
        return self.fail(list(self._seqs), error)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[TokenDelta]:
        """Run one scheduler step, and return the new tokens of every sequence that got one.

        Raises `StepFailed`, naming the step's sequences, if the step raised once they
        were scheduled.
        """
        with self._stepping:
            if self._closed:
                return []
            drafted = self.speculator.draft(self.scheduler.running) \
                if self.speculator else {}
            scheduled = self.scheduler.schedule()
            drafted = Speculator.settle(drafted, scheduled) if drafted else drafted
            start = time.perf_counter()
            try:
                if not scheduled:  # a lockstep backend's idle round
                    return self._step(scheduled, drafted)
                with step_span(scheduled) as span:
                    deltas = self._step(scheduled, drafted)
                    if span is not None and drafted:
                        span.set_attribute("switchyard.drafted", sum(drafted.values()))
                        span.set_attribute("switchyard.accepted", self._accepted)
            except Exception as exc:
                raise StepFailed(exc, [item.seq.request_id for item in scheduled]) from exc
            # The step's kind depends on whether every sequence decoded one token, plus its
            # drafts.
            self.num_steps += 1
            _STEP_KINDS[all(item.num_new_tokens == 1 + drafted.get(item.seq, 0)
                            for item in scheduled)].observe(time.perf_counter() - start)
            return deltas

    def _step(self, scheduled: list[ScheduledSeq], drafted: dict[Sequence, int]
              ) -> list[TokenDelta]:
        """Run one step over `scheduled`.

        `drafted` maps each sequence whose last tokens this step are drafts to how many
        drafts it has.
        """
        now = time.monotonic()
        for item in scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        forward = self.runner.run(scheduled)
        if forward is None:
            return []
        self._score_prompts(scheduled, forward.hidden)
        # The sequences that sample, and each one's rows of the step's tokens.
        sampling, rows, first = [], [], 0
        mtp = self.speculator is not None and self.speculator.mtp is not None
        # For MTP: each sequence's positions this step. Drafts count once verified.
        settled = []
        for item in scheduled:
            seq, n = item.seq, item.num_new_tokens
            if mtp:
                settled.append(Settled(seq, seq.num_computed_tokens, first, n))
            if seq.num_computed_tokens + n == seq.num_tokens:
                sampling.append(seq)
                rows.append(range(first + n - 1 - drafted.get(seq, 0), first + n))
            first += n
            # The drafts' KV counts once `_emit` accepts them.
            seq.num_computed_tokens += n - drafted.get(seq, 0)
            if seq not in drafted:
                self.block_manager.cache_computed(seq)
        deltas = self._sample(sampling, rows, drafted, forward.hidden) if sampling else []
        if mtp:
            assert self.speculator is not None
            verified = {d.request_id: len(d.token_ids) for d in deltas}
            self.speculator.after_step(
                [replace(s, count=verified[s.seq.request_id]) if s.seq in drafted else s
                 for s in settled], forward.hidden, len(self.scheduler.running))
        return deltas

    def _sample(self, sampling: list[Sequence], rows: list[range],
                drafted: dict[Sequence, int], hidden: torch.Tensor) -> list[TokenDelta]:
        """The tokens of the sequences that sample this step, verified where they drafted.

        `rows` holds each sequence's rows of the step's `hidden` [T, H]: its drafts' rows
        and the one after them.
        """
        logits = self.runner.logits(hidden[[r for span in rows for r in span]])
        plain = [i for i, seq in enumerate(sampling) if seq not in drafted]
        firsts = list(accumulate((len(span) for span in rows), initial=0))
        sampled = sample(logits[[firsts[i] for i in plain]], [sampling[i] for i in plain],
                         self.model_config.eos_token_ids) if plain else None
        deltas, j = [], 0
        self._accepted = 0
        for i, seq in enumerate(sampling):
            if seq in drafted:
                k = drafted[seq]
                emitted, logprobs = Speculator.accept(seq, k,
                                                      logits[firsts[i]:firsts[i] + k + 1])
                self._accepted += len(emitted) - 1
                deltas.append(self._emit(seq, emitted, logprobs))
            else:
                assert sampled is not None
                entry = sampled.logprobs[j]
                deltas.append(self._append(seq, [sampled.tokens[j]],
                                           None if entry is None else [entry]))
                j += 1
        return deltas

    def _emit(self, seq: Sequence, emitted: list[int],
              logprobs: list[TokenLogprobs] | None) -> TokenDelta:
        """Append a speculating sequence's verified tokens.

        The accepted drafts' KV now counts as computed, because it was computed for these
        very tokens.
        """
        self.block_manager.cache_computed(seq)  # what it held before the drafts
        delta = self._append(seq, emitted, logprobs)
        if seq.finish_reason is None:  # otherwise its blocks are gone
            seq.num_computed_tokens += len(emitted) - 1
            self.block_manager.cache_computed(seq)
        return delta

    def _score_prompts(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor) -> None:
        """Score prompt logprobs for each sequence that asks for them.

        For each prompt token that this step's rows (hidden [T, H]) predict, this computes
        its log-probability, once. A preempted sequence recomputes its rows, but not its
        scores.
        """
        rows: list[int] = []
        targets: list[int] = []
        owners: list[Sequence] = []
        first = 0
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            if seq.sampling.prompt_logprobs is not None:
                # The row of position p predicts token p + 1. A prompt's last row samples.
                for pos in range(max(start, len(seq.prompt_logprobs) - 1),
                                 min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)):
                    rows.append(first + pos - start)
                    targets.append(seq.token_ids[pos + 1])
                    owners.append(seq)
            first += item.num_new_tokens
        # lm_head over at most PROMPT_LOGITS_ELEMENTS float32 logits at a time
        step = max(1, PROMPT_LOGITS_ELEMENTS // self.model_config.vocab_size)
        for i in range(0, len(rows), step):
            index = torch.tensor(rows[i:i + step], device=hidden.device)
            entries = token_logprobs(self.runner.logits(hidden[index]), targets[i:i + step],
                                     [s.sampling.prompt_logprobs or 0
                                      for s in owners[i:i + step]])
            for seq, entry in zip(owners[i:i + step], entries, strict=True):
                seq.prompt_logprobs.append(entry)

    def _append(self, seq: Sequence, tokens: list[int],
                logprobs: list[TokenLogprobs] | None) -> TokenDelta:
        """Append `tokens` to `seq` in turn, up to the first that ends it.

        Returns their delta. Where asked for, `logprobs` holds one entry per token.
        """
        first = seq.num_output_tokens == 0
        p = seq.sampling
        error = None
        emitted = []
        for token in tokens:
            seq.token_ids.append(token)
            emitted.append(token)
            if token in p.stop_token_ids or (token in self.model_config.eos_token_ids
                                             and not p.ignore_eos):
                seq.finish_reason = "stop"
            elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.matcher is not None and seq.finish_reason is None:
                if not seq.matcher.consume_token(token):  # the grammar allowed no token left
                    seq.finish_reason = "error"  # e.g. allowed_token_ids outside it
                    error = f"structured outputs: {seq.matcher.get_error()}"
                elif seq.matcher.is_stopped():  # complete
                    seq.finish_reason = "stop"
            if seq.finish_reason:
                break
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if seq.finish_reason:
            self.scheduler.finish(seq)
            del self._seqs[seq.request_id]
            trace_request(seq, seq.finish_reason)
        queue_s = prefill_s = None
        if first and seq.first_scheduled_time is not None:
            queue_s = seq.first_scheduled_time - seq.arrival_time
            prefill_s = time.monotonic() - seq.first_scheduled_time
        prompt = seq.prompt_logprobs if first and p.prompt_logprobs is not None else None
        return TokenDelta(seq.request_id, emitted, seq.finish_reason, seq.num_prompt_tokens,
                          error, logprobs=None if logprobs is None
                          else logprobs[:len(emitted)],
                          queue_time_s=queue_s, prefill_time_s=prefill_s,
                          prompt_logprobs=prompt,
                          num_cached_tokens=seq.num_cached_tokens if first else None)

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits [L, V] at every position of a prompt, for prompt scoring.

        They go through the paged KV path in chunks of the step budget. The sequence is
        freed afterwards.
        """
        seq = Sequence("score", list(token_ids), len(token_ids), _SCORE_PARAMS)
        logits = []
        try:
            while seq.num_computed_tokens < seq.num_tokens:
                n = min(seq.num_tokens - seq.num_computed_tokens,
                        self.config.max_num_batched_tokens)
                self.block_manager.allocate(seq, n)
                logits.append(self.runner.score(ScheduledSeq(seq, n)))
                seq.num_computed_tokens += n
        finally:
            self.block_manager.free(seq)
        return torch.cat(logits)


_SCORE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
PROMPT_LOGITS_ELEMENTS = 2**25  # 128 MiB of float32 logits per lm_head call of prompt scoring
