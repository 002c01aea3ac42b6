"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError, bad_request
from gateway.logprobs import completion_logprobs
from gateway.openai_protocol import Completion, CompletionChoice, CompletionRequest, Usage
from gateway.output import Output, interleave
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


def _echo_text(prompt: str | list[int], tokenizer: Tokenizer | None,
               prompt_token_ids: list[int]) -> str:
    """A prompt as text for `echo`; its ids already checked (an id past the vocabulary
    would make the tokenizer raise)."""
    if isinstance(prompt, str):
        return prompt
    assert tokenizer is not None  # taken before the request started
    return tokenizer.decode(prompt_token_ids)


def _usage(runs: list[Run], completion_tokens: int) -> Usage:
    prompt_tokens = sum(len(run.prompt_token_ids) for run in runs)
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


async def _events(runs: list[Run], body: CompletionRequest, shapers: list[_ChoiceText]
                  ) -> AsyncIterator[bytes]:
    """The SSE stream; a choice's first chunk carries its echo and (with
    `return_token_ids`) the prompt's ids."""
    first, completion_tokens = runs[0], 0
    try:
        async for index, step in interleave([c.steps for run in runs for c in run.choices]):
            completion_tokens += len(step.token_ids)
            choice = shapers[index].choice(index, step)
            if choice.text or step.finish_reason or choice.token_ids or choice.logprobs:
                yield event(Completion(first.id, first.created, first.model, [choice], None))
    except GatewayError as exc:
        yield error_event(exc)
    else:
        if body.include_usage:
            usage = _usage(runs, completion_tokens)
            yield event(Completion(first.id, first.created, first.model, [], usage))
    yield DONE


async def _start(serving: Serving, request: Request, body: CompletionRequest,
                 prompts: list[list[int]]) -> list[Run]:
    """One run per prompt, each with the request's n choices; all or none."""
    if len(prompts) > 1:  # before any request starts: a batch that cannot fit is refused
        serving.check_room(len(prompts) * body.n, f"{len(prompts)} prompts x n={body.n}")
    runs: list[Run] = []
    try:
        for prompt_token_ids in prompts:
            runs.append(await serving.start(request, "cmpl", prompt_token_ids, body))
    except BaseException:
        for run in runs:
            await run.aclose()
        raise
    return runs


async def create_completion(serving: Serving, request: Request) -> Response:
    """Continue a prompt (or each of a batch) given as text or as token ids."""
    body = await serving.parse(request, CompletionRequest)
    prompts = body.prompts
    ids = [p if isinstance(p, list) else serving.tokenizer.encode(p) for p in prompts]
    if body.echo and body.logprobs is not None:
        raise bad_request("echo with logprobs (prompt logprobs) is not supported.", "echo")
    # Before any place is taken: echoing token ids needs the tokenizer (a 400 without one).
    needs_tokenizer = body.echo and any(isinstance(p, list) for p in prompts)
    tokenizer = serving.tokenizer if needs_tokenizer else None
    runs = await _start(serving, request, body, ids)  # checks each prompt

    async def close() -> None:
        for run in runs:
            await run.aclose()

    try:
        shapers = [_ChoiceText(serving, body, run,
                               _echo_text(p, tokenizer, i) if body.echo else "")
                   for p, i, run in zip(prompts, ids, runs, strict=True) for _ in run.choices]
    except BaseException:  # the runs hold places and engine requests
        await close()
        raise
    if body.stream:
        return EventStreamResponse(_events(runs, body, shapers), close)
    outs = await serving.complete(request, *runs)
    if outs is None:
        return client_gone()
    choices = [shapers[i].choice(i, out) for i, out in enumerate(outs)]
    usage = _usage(runs, sum(len(out.token_ids) for out in outs))
    first = runs[0]
    return json_response(Completion(first.id, first.created, first.model, choices, usage))
