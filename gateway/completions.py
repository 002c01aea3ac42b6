"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError, bad_request
from gateway.logprobs import completion_logprobs
from gateway.openai_protocol import Completion, CompletionChoice, CompletionRequest
from gateway.output import Output
from gateway.serving import Run, Serving, client_gone, json_response
from gateway.sse import DONE, EventStreamResponse, error_event, event
from gateway.tokenizer import Tokenizer


class _ChoiceText:
    """Shapes one choice's outputs: echo prefix, token ids, logprobs with text offsets."""

    def __init__(self, serving: Serving, body: CompletionRequest, run: Run, echo: str) -> None:
        self._serving, self._body, self._run = serving, body, run
        self._prefix = echo  # sent with the choice's first output
        self._offset = len(echo)
        self._prompt_ids: list[int] | None = run.prompt_token_ids

    def choice(self, index: int, step: Output) -> CompletionChoice:
        with_ids, text = self._body.return_token_ids, self._prefix + step.text
        prompt_ids, self._prompt_ids, self._prefix = self._prompt_ids, None, ""
        logprobs = None
        if self._body.logprobs is not None:
            tokenizer = self._serving.maybe_tokenizer
            logprobs = completion_logprobs(tokenizer, step.token_ids, step.logprobs,
                                           self._offset)
            self._offset += sum(map(len, logprobs.tokens))
        return CompletionChoice(index, text, step.finish_reason, logprobs,
                                prompt_ids if with_ids else None,
                                step.token_ids if with_ids else None)


def _echo_text(body: CompletionRequest, tokenizer: Tokenizer | None,
               prompt_token_ids: list[int]) -> str:
    """The prompt as text for `echo`; its ids already checked (an id past the vocabulary
    would make the tokenizer raise)."""
    if not body.echo:
        return ""
    if isinstance(body.prompt, str):
        return body.prompt
    assert tokenizer is not None  # taken before the request started
    return tokenizer.decode(prompt_token_ids)


async def _events(run: Run, body: CompletionRequest, shapers: list[_ChoiceText]
                  ) -> AsyncIterator[bytes]:
    """The SSE stream; a choice's first chunk carries its echo and (with
    `return_token_ids`) the prompt's ids."""
    completion_tokens = 0
    try:
        async for index, step in run.stream():
            completion_tokens += len(step.token_ids)
            choice = shapers[index].choice(index, step)
            if choice.text or step.finish_reason or choice.token_ids or choice.logprobs:
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
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs (prompt logprobs) is not supported.", "echo")
    # Before any place is taken: echoing token ids needs the tokenizer (a 400 without one).
    tokenizer = serving.tokenizer if body.echo and isinstance(prompt, list) else None
    run = await serving.start(request, "cmpl", prompt_token_ids, body)  # checks the prompt
    echo = _echo_text(body, tokenizer, prompt_token_ids)
    shapers = [_ChoiceText(serving, body, run, echo) for _ in run.choices]
    if body.stream:
        return EventStreamResponse(_events(run, body, shapers), run.aclose)
    outs = await serving.complete(request, run)
    if outs is None:
        return client_gone()
    choices = [shapers[i].choice(i, out) for i, out in enumerate(outs)]
    usage = run.usage(sum(len(out.token_ids) for out in outs))
    return json_response(Completion(run.id, run.created, run.model, choices, usage))
