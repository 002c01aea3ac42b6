"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError
from gateway.openai_protocol import Completion, CompletionChoice, CompletionRequest
from gateway.output import Output
from gateway.serving import Run, Serving, client_gone, json_response
from gateway.sse import DONE, EventStreamResponse, error_event, event


def _choice(step: Output, prompt_token_ids: list[int] | None, with_ids: bool) -> CompletionChoice:
    """A choice; token ids are attached only when the client asked (`return_token_ids`)."""
    return CompletionChoice(0, step.text, step.finish_reason, None,
                            prompt_token_ids if with_ids else None,
                            step.token_ids if with_ids else None)


async def _events(run: Run, body: CompletionRequest) -> AsyncIterator[bytes]:
    """The SSE stream; with `return_token_ids` the first chunk carries the prompt's ids."""
    with_ids = body.return_token_ids
    prompt_ids: list[int] | None = run.prompt_token_ids
    completion_tokens = 0
    try:
        async for step in run.steps:
            completion_tokens += len(step.token_ids)
            if step.text or step.finish_reason or with_ids:
                choice = _choice(step, prompt_ids, with_ids)
                prompt_ids = None
                yield event(Completion(run.id, run.created, run.model, [choice], None))
    except GatewayError as exc:
        yield error_event(exc)
    else:
        if body.include_usage:
            usage = run.usage(completion_tokens)
            yield event(Completion(run.id, run.created, run.model, [], usage))
    yield DONE


async def create_completion(serving: Serving, request: Request) -> Response:
    """Continue a prompt given as text or as token ids."""
    body = await serving.parse(request, CompletionRequest)
    prompt = body.prompt
    prompt_token_ids = prompt if isinstance(prompt, list) else serving.tokenizer.encode(prompt)
    run = await serving.start(request, "cmpl", prompt_token_ids, body)
    if body.stream:
        return EventStreamResponse(_events(run, body), run.generation.aclose)
    whole = await serving.complete(request, run)
    if whole is None:
        return client_gone()
    choice = _choice(whole, prompt_token_ids, body.return_token_ids)
    usage = run.usage(len(whole.token_ids))
    return json_response(Completion(run.id, run.created, run.model, [choice], usage))
