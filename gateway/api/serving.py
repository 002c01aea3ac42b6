"""What the OpenAI endpoints share: parsing, limits, admission, and starting a generation."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
from opentelemetry.trace import (
    INVALID_SPAN,
    Span,
    SpanKind,
    StatusCode,
    format_trace_id,
    set_span_in_context,
)
from starlette.requests import Request
from starlette.responses import Response

from common import tracing
from common.messages import EngineInfo, GenerateRequest, SamplingParams
from gateway.api.output import Output, StopStrings, collect, interleave, outputs
from gateway.api.protocol import SamplingFields, Usage, refuse_not_built
from gateway.api.sampling import ModelLimits, sampling_params
from gateway.api.sse import unless_disconnected
from gateway.config import GatewayConfig
from gateway.errors import GatewayError, bad_request, engine_unavailable
from gateway.generation_config import NEUTRAL
from gateway.observability.metrics import Metrics, RequestTimer
from gateway.observability.request_log import RequestLog, RequestRecord
from gateway.routing.engine_pool import EnginePool, FailoverGeneration
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.tokenizer import NO_TOKENIZER_MESSAGE, Tokenizer

log = logging.getLogger(__name__)
RequestT = TypeVar("RequestT", bound=msgspec.Struct)
_TRACE_HEADERS = ("traceparent", "tracestate")
_SEED_SPACE = 2**63


@dataclass
class Choice:
    """One of a request's `n` independent generations."""

    index: int
    generation: FailoverGeneration
    steps: AsyncIterator[Output]
    timer: RequestTimer


@dataclass
class Run:
    """One accepted request: its identity, its choices, and its place in the queue."""

    id: str
    created: int
    model: str
    prompt_token_ids: list[int]
    choices: list[Choice] = field(default_factory=list)
    span: Span = INVALID_SPAN  # the request's trace span; a no-op span when tracing is off
    # The id of its engine requests, with `-{i}` added per choice. "" means `id` is used.
    engine_id: str = ""
    _serving: Serving | None = None
    _places: int = 0  # queue places taken at admission, all `n` whether or not each choice started
    _details: bool = False  # --enable-prompt-tokens-details

    def usage(self, completion_tokens: int) -> Usage:
        """Token counts for this request once `completion_tokens` were generated."""
        return Usage.of(len(self.prompt_token_ids), completion_tokens, self.cached_tokens)

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the prefix cache held for the first choice, which is what vLLM
        reports. None unless --enable-prompt-tokens-details is set."""
        if not self._details or not self.choices:
            return None
        return self.choices[0].timer.num_cached_tokens

    def stream(self) -> AsyncIterator[tuple[int, Output]]:
        """Yield (choice index, output) pairs as the choices produce them."""
        return interleave([c.steps for c in self.choices])

    async def aclose(self) -> None:
        """Abort whatever still runs and leave the queue.

        This is for when the client has gone or a stop string has ended the output.
        """
        for choice in self.choices:
            choice.timer.finish("abort")  # does nothing for finished choices
            await choice.generation.aclose()
        if self._serving is not None:
            self._serving.admission.release(self._places)
            self._end(self._serving.requests)
            self._serving = None

    def _end(self, log: RequestLog) -> None:
        """End the request's span and log it."""
        timers = [c.timer for c in self.choices]
        firsts = [t.ttft_s for t in timers if t.ttft_s is not None]
        reasons = [t.finish_reason or "abort" for t in timers]
        context = self.span.get_span_context()
        log.add(RequestRecord(
            self.id, time.time(), max((t.e2e_s or 0.0 for t in timers), default=0.0),
            min(firsts) if firsts else None, sum(t.num_tokens for t in timers),
            tuple(reasons), format_trace_id(context.trace_id) if context.is_valid else None))
        self.span.set_attributes({
            "gen_ai.usage.output_tokens": sum(t.num_tokens for t in timers),
            "gen_ai.response.finish_reasons": reasons,
            **({"switchyard.time_to_first_token_s": min(firsts)} if firsts else {}),
        })
        # The engine failed a choice. Trace UIs flag spans with this status.
        if "error" in reasons:
            self.span.set_status(StatusCode.ERROR, "the engine failed a choice")
        self.span.end()


def json_response(body: object) -> Response:
    """A 200 JSON response encoded by msgspec."""
    return Response(msgspec.json.encode(body), media_type="application/json")


def client_gone() -> Response:
    """What a handler returns when its client already left; nobody will read it."""
    return Response(status_code=499)


def _error_param(exc: msgspec.ValidationError) -> str | None:
    # msgspec ends its messages with "- at `$.field[0]`". OpenAI's `param` names the field.
    _, sep, path = str(exc).rpartition(" - at `$.")
    return path.rstrip("`").split("[")[0].split(".")[0] if sep else None


class Admission:
    """The places for choices: what the engines run at once plus --max-queued-requests.

    A request takes a place per choice when it is accepted, and gives them back when it
    ends. A request that does not fit in the free places is refused with a 429, or with a
    400 if it could never fit.
    """

    def __init__(self, config: GatewayConfig, engine: EnginePool, metrics: Metrics) -> None:
        self.config, self.engine, self.metrics = config, engine, metrics
        self.admitted = 0  # choices accepted and not yet finished

    def check_room(self, n: int, asked: str | None = None) -> None:
        """Refuse `n` places if they do not fit now.

        Raises a 400 if they could never fit, and a 429 while running plus queued choices
        would overflow. `asked` names the places in the 400; the default is "n=N".
        """
        capacity = self.engine.max_num_seqs() + self.config.max_queued_requests
        if n > capacity:  # refused forever, so not a reason to retry
            raise bad_request(f"{asked or f'n={n}'} is more than this server runs or queues "
                              f"at once ({capacity}).", "n")
        if self.admitted + n > capacity:
            self.metrics.rejected.labels(self.config.served_model_name).inc()
            raise GatewayError(429, f"The server is overloaded: {self.admitted} requests are "
                               "running or queued. Retry later.",
                               headers={"Retry-After": str(self.config.retry_after_s)})

    def admit(self, n: int) -> None:
        """Take `n` places, or refuse them as `check_room` does."""
        self.check_room(n)
        self.admitted += n

    def release(self, n: int) -> None:
        self.admitted -= n


class Serving:
    """What the OpenAI endpoints share.

    That is parsing request bodies and checking their limits, the tokenizer, admission,
    and starting a request's generations on the engines, with their metrics, trace span
    and log entry.
    """

    def __init__(self, config: GatewayConfig, engine: EnginePool,
                 tokenizer: Tokenizer | None, metrics: Metrics | None = None,
                 requests: RequestLog | None = None) -> None:
        self.config = config
        self.engine = engine
        self.metrics = metrics or Metrics(config.served_model_name)
        self.requests = requests or RequestLog()
        self.admission = Admission(config, engine, self.metrics)
        self._tokenizer = tokenizer
        if config.sampling_defaults != NEUTRAL:
            log.warning("sampling defaults from the model's generation config: %s (start "
                        "with --generation-config vllm for neutral ones)",
                        config.sampling_defaults.describe())
        self._unknown_fields: set[str] = set()

    async def read_body(self, request: Request) -> bytes:
        """Read the request body. A body larger than --max-request-body-size gets 413."""
        limit = self.config.max_request_body_bytes
        too_large = GatewayError(413, f"The request body exceeds {limit} bytes.")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(self, request: Request, kind: type[RequestT]) -> RequestT:
        """Decode and validate a JSON body, and check it names the served model."""
        try:
            raw = msgspec.json.decode(await self.read_body(request))
        except msgspec.DecodeError as exc:
            raise bad_request(f"Invalid JSON in request body: {exc}") from None
        except RecursionError:
            raise bad_request("The request body is nested too deeply.") from None
        if not isinstance(raw, dict):
            raise bad_request("The request body must be a JSON object.")
        # null is "not given", as the OpenAI client sends a None and vLLM reads it.
        raw = {name: value for name, value in raw.items() if value is not None}
        if issubclass(kind, SamplingFields):  # requests that generate, not /tokenize
            refuse_not_built(raw, kind.__struct_fields__)
        self._note_unknown_fields(raw, kind)
        try:
            body = msgspec.convert(raw, kind)
        except msgspec.ValidationError as exc:
            raise bad_request(str(exc), _error_param(exc)) from None
        model = getattr(body, "model", None)
        if model is not None and model != self.config.served_model_name:
            raise GatewayError(404, f"The model `{model}` does not exist.", "model")
        return body

    def _note_unknown_fields(self, raw: dict, kind: type[msgspec.Struct]) -> None:
        # Unknown fields are accepted and ignored, like vLLM does. Each name is logged once,
        # so a flood of them cannot fill the logs.
        for name in raw.keys() - set(kind.__struct_fields__) - self._unknown_fields:
            if len(self._unknown_fields) < 1000:
                self._unknown_fields.add(name)
                log.warning("ignoring unknown request field %r", name)

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, or a 400 explaining that only token-id prompts work."""
        if self._tokenizer is None:
            raise bad_request(NO_TOKENIZER_MESSAGE)
        return self._tokenizer

    @property
    def maybe_tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    def max_model_len(self, info: EngineInfo | None) -> int | None:
        """The context length we enforce: the engine's, or --max-model-len if lower."""
        engine_len = info.max_model_len if info is not None else None
        lengths = [n for n in (self.config.max_model_len, engine_len) if n is not None]
        return min(lengths) if lengths else None

    def _engine_info(self) -> EngineInfo:
        info = self.engine.info
        if info is None:
            raise engine_unavailable("not connected to the engine yet")
        return info

    async def start(self, request: Request, kind: str, prompt_token_ids: list[int],
                    body: SamplingFields) -> Run:
        """Validate the request against the model, queue it, and start its choices."""
        info = self._engine_info()
        limits = ModelLimits(self.max_model_len(info) or info.max_model_len, info.vocab_size)
        if (keep := body.truncate_prompt_tokens) is not None:  # as vLLM, keep the last `keep`
            keep = limits.max_model_len if keep == -1 else keep
            prompt_token_ids = prompt_token_ids[max(0, len(prompt_token_ids) - keep):] \
                if keep else []
        sampling = sampling_params(body, prompt_token_ids, limits,
                                   self.config.sampling_defaults)
        self.admission.admit(body.n)
        run = Run(f"{kind}-{uuid.uuid4().hex}", int(time.time()),
                  self.config.served_model_name, prompt_token_ids, _serving=self,
                  _places=body.n, _details=self.config.enable_prompt_tokens_details)
        if client_id := request.headers.get("x-request-id"):
            # vLLM answers with the client's id. Engine ids stay unique whatever it sends.
            run.engine_id = f"{kind}-{client_id}-{uuid.uuid4().hex[:8]}"
            run.id = f"{kind}-{client_id}"
        try:
            self.metrics.prompt_tokens.labels(run.model).inc(len(prompt_token_ids))
            run.span = self._request_span(request, kind, run, sampling)
            # Unsampled requests send no context, so downstream records nothing for them.
            trace = tracing.inject(set_span_in_context(run.span)) \
                if run.span.is_recording() else {}
            stop_ids = frozenset(sampling.stop_token_ids) | frozenset(info.eos_token_ids)
            for index in range(body.n):
                run.choices.append(await self._start_choice(
                    run, index, body, _choice_sampling(sampling, index, body), trace,
                    stop_ids))
        except BaseException:
            await run.aclose()
            raise
        return run

    def _request_span(self, request: Request, kind: str, run: Run,
                      sampling: SamplingParams) -> Span:
        """The request's span, continuing the client's W3C trace if it sent one."""
        client = {h: v for h in _TRACE_HEADERS if (v := request.headers.get(h)) is not None}
        operation = "chat" if kind == "chatcmpl" else "text_completion"
        return tracing.tracer().start_span(
            f"{operation} {run.model}", context=tracing.extract(client), kind=SpanKind.SERVER,
            attributes={"gen_ai.operation.name": operation,
                        "gen_ai.request.model": run.model,
                        "gen_ai.request.max_tokens": sampling.max_tokens,
                        "gen_ai.request.temperature": sampling.temperature,
                        "gen_ai.request.top_p": sampling.top_p,
                        "gen_ai.usage.input_tokens": len(run.prompt_token_ids),
                        "gen_ai.response.id": run.id})

    def _reason_ids(self, sampling: SamplingParams) -> set[int]:
        """The token ids that become a choice's `stop_reason` when they end it, as in vLLM.

        These are the request's stop ids and the model's EOS ids other than the
        tokenizer's EOS. The tokenizer's EOS is left out because it stops a generation as
        an EOS. With ignore_eos, the other EOS ids do not stop either, so only the
        request's stop ids count.
        """
        if sampling.ignore_eos:
            return set(sampling.stop_token_ids)
        eos = self._engine_info().eos_token_ids
        primary = self._tokenizer.eos_token_id if self._tokenizer is not None else None
        if primary is None and eos:
            primary = eos[0]  # the first one in config.json
        return {*sampling.stop_token_ids, *eos} - {primary}

    async def _start_choice(self, run: Run, index: int, body: SamplingFields,
                            sampling: SamplingParams, trace: dict[str, str],
                            stop_ids: frozenset[int]) -> Choice:
        timer = RequestTimer(self.metrics)
        engine_id = run.engine_id or run.id
        request_id = engine_id if body.n == 1 else f"{engine_id}-{index}"
        generation = await self.engine.start(
            GenerateRequest(request_id, run.prompt_token_ids, sampling, trace,
                            body.cache_salt))
        detokenizer = IncrementalDetokenizer(self._tokenizer, run.prompt_token_ids,
                                             body.skip_special_tokens)
        stops = StopStrings(body.stop_strings, body.include_stop_str_in_output) \
            if body.stop_strings else None
        reason_ids = self._reason_ids(sampling)
        return Choice(index, generation, outputs(
            generation, detokenizer, stop_ids, stops, timer, body.min_tokens,
            keep_stop_token=body.include_stop_str_in_output, reason_ids=reason_ids), timer)

    async def complete(self, request: Request, *runs: Run) -> list[Output] | None:
        """Every choice's whole output, run after run.

        Returns None if the client left, in which case the runs were aborted.
        """
        async def gather() -> list[Output]:
            return list(await asyncio.gather(*(collect(c.steps) for run in runs
                                               for c in run.choices)))

        try:
            return await unless_disconnected(request, gather)
        finally:
            for run in runs:
                await run.aclose()


def _choice_sampling(sampling: SamplingParams, index: int, body: SamplingFields
                     ) -> SamplingParams:
    """The sampling parameters for choice `index`.

    Choice i of a seeded request uses seed + i, so the n choices differ but can be
    reproduced. If the response scores the prompt only once, choice 0's engine request
    does the scoring.
    """
    if index == 0:
        return sampling
    if sampling.prompt_logprobs is not None and not body.prompt_scored_per_choice:
        sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
    if sampling.seed is None:
        return sampling
    return msgspec.structs.replace(sampling, seed=(sampling.seed + index) % _SEED_SPACE)
