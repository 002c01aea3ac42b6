"""What the OpenAI endpoints share: parsing, limits, and starting a generation."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.config import GatewayConfig
from gateway.detokenizer import IncrementalDetokenizer
from gateway.engine_client import Generation
from gateway.engine_pool import EnginePool
from gateway.errors import GatewayError, bad_request, engine_unavailable
from gateway.openai_protocol import SamplingFields, Usage
from gateway.output import Output, collect, outputs
from gateway.sampling import ModelLimits, sampling_params
from gateway.sse import unless_disconnected
from gateway.tokenizer import NO_TOKENIZER_MESSAGE, Tokenizer
from switchyard.messages import EngineInfo, GenerateRequest

RequestT = TypeVar("RequestT", bound=SamplingFields)
_TRACE_HEADERS = ("traceparent", "tracestate")


@dataclass(frozen=True)
class Run:
    """One accepted request: its identity, its engine generation, and its text outputs."""

    id: str
    created: int
    model: str
    prompt_token_ids: list[int]
    generation: Generation
    steps: AsyncIterator[Output]

    def usage(self, completion_tokens: int) -> Usage:
        """Token counts for this request once `completion_tokens` were generated."""
        prompt_tokens = len(self.prompt_token_ids)
        return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def json_response(body: object) -> Response:
    """A 200 JSON response encoded by msgspec."""
    return Response(msgspec.json.encode(body), media_type="application/json")


def client_gone() -> Response:
    """What a handler returns when its client already left; nobody will read it."""
    return Response(status_code=499)


def _error_param(exc: msgspec.ValidationError) -> str | None:
    # msgspec ends its messages with "- at `$.field[0]`"; OpenAI's `param` names the field.
    _, sep, path = str(exc).rpartition(" - at `$.")
    return path.rstrip("`").split("[")[0].split(".")[0] if sep else None


class Serving:
    """The gateway's shared state, as the endpoints see it."""

    def __init__(self, config: GatewayConfig, engine: EnginePool,
                 tokenizer: Tokenizer | None) -> None:
        self.config = config
        self.engine = engine
        self._tokenizer = tokenizer

    async def parse(self, request: Request, kind: type[RequestT]) -> RequestT:
        """Decode and validate a JSON body, and check it names the served model."""
        try:
            body = msgspec.json.decode(await request.body(), type=kind)
        except msgspec.ValidationError as exc:
            raise bad_request(str(exc), _error_param(exc)) from None
        except msgspec.DecodeError as exc:
            raise bad_request(f"Invalid JSON in request body: {exc}") from None
        if body.model is not None and body.model != self.config.served_model_name:
            raise GatewayError(404, f"The model `{body.model}` does not exist.", "model")
        return body

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer, or a 400 explaining that only token-id prompts work."""
        if self._tokenizer is None:
            raise bad_request(NO_TOKENIZER_MESSAGE)
        return self._tokenizer

    def max_model_len(self, info: EngineInfo | None) -> int | None:
        """The context length we enforce: the engine's, lowered by --max-model-len."""
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
        """Validate the request against the model and start generating."""
        info = self._engine_info()
        limits = ModelLimits(self.max_model_len(info) or info.max_model_len, info.vocab_size)
        sampling = sampling_params(body, prompt_token_ids, limits)
        request_id = f"{kind}-{uuid.uuid4().hex}"
        trace = {h: v for h in _TRACE_HEADERS if (v := request.headers.get(h)) is not None}
        generation = await self.engine.start(
            GenerateRequest(request_id, prompt_token_ids, sampling, trace)
        )
        detokenizer = IncrementalDetokenizer(self._tokenizer, prompt_token_ids)
        stop_ids = frozenset(sampling.stop_token_ids) | frozenset(info.eos_token_ids)
        return Run(request_id, int(time.time()), self.config.served_model_name,
                   prompt_token_ids, generation, outputs(generation, detokenizer, stop_ids))

    async def complete(self, request: Request, run: Run) -> Output | None:
        """The whole output of a non-streamed request; None if the client left (and we aborted)."""
        try:
            return await unless_disconnected(request, lambda: collect(run.steps))
        finally:
            await run.generation.aclose()
