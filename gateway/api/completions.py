"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from common.messages import TokenLogprobs
from gateway.api.logprobs import completion_logprobs
from gateway.api.logprobs import prompt_logprobs as to_prompt_logprobs
from gateway.api.output import Output, interleave
from gateway.api.protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Usage,
)
from gateway.api.serving import Run, Serving, client_gone, json_response
from gateway.api.sse import DONE, EventStreamResponse, error_event, event
from gateway.errors import GatewayError, engine_unavailable
from gateway.text.tokenizer import Tokenizer


class _ChoiceText:
    """Shapes one choice's outputs.

    It adds the echo prefix, the token ids, and logprobs with text offsets. The first
    output also carries what belongs to the prompt: its ids and its log-probabilities.
    """

    def __init__(self, serving: Serving, body: CompletionRequest, run: Run, echo: str) -> None:
        # The tokenizer that names tokens in logprobs. None writes vLLM's `token_id:N`.
        self._tokenizer = None if body.return_tokens_as_token_ids else serving.maybe_tokenizer
        self._body = body
        self._prefix = echo  # sent with the choice's first output
        self._offset = len(echo)  # where the generated text starts in the choice's text
        self._prompt_ids = run.prompt_token_ids
        self._first = True

    def choice(self, index: int, step: Output) -> CompletionChoice:
        body, first, self._first = self._body, self._first, False
        token_ids, entries, text = step.token_ids, step.logprobs, step.text
        finish, stop_reason = step.finish_reason, step.stop_reason
        # As in vLLM, the one token the engine generated is left out, and with it whatever
        # ended it, such as an EOS. Zero tokens were asked for and zero are given, so the
        # finish reason is "length".
        if body.echo_only:
            token_ids, entries, text = [], [], ""
            finish, stop_reason = ("length" if finish is not None else None), None
        if first:
            text = self._prefix + text
        logprobs = head = None
        if body.logprobs is not None:
            if first and body.echo:  # the echoed prompt's tokens come first
                head = completion_logprobs(self._tokenizer, self._prompt_ids,
                                           self._scores(step))
                # As in vLLM, offsets count the tokens' texts over prompt and output. So
                # they grow even where those texts are not in the prompt, as for a BOS token.
                self._offset = sum(map(len, head.tokens))
            logprobs = completion_logprobs(self._tokenizer, token_ids, entries, self._offset)
            self._offset += sum(map(len, logprobs.tokens))
            if head is not None:
                logprobs = _joined(head, logprobs)
        prompt_logprobs = None
        if first and body.num_prompt_logprobs is not None:
            prompt_logprobs = to_prompt_logprobs(self._tokenizer, self._prompt_ids,
                                                 self._scores(step))
        with_ids = body.return_token_ids
        return CompletionChoice(index, text, finish, logprobs, stop_reason,
                                self._prompt_ids if with_ids and first else None,
                                token_ids if with_ids else None, prompt_logprobs)

    def _scores(self, step: Output) -> list[TokenLogprobs | None]:
        if step.prompt_logprobs is None or len(step.prompt_logprobs) != len(self._prompt_ids):
            raise engine_unavailable("the engine sent no prompt logprobs for this prompt")
        return step.prompt_logprobs


def _joined(head: CompletionLogprobs, tail: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(head.text_offset + tail.text_offset,
                              head.token_logprobs + tail.token_logprobs,
                              head.tokens + tail.tokens, head.top_logprobs + tail.top_logprobs)


def _echo_text(prompt: str | list[int], tokenizer: Tokenizer | None,
               prompt_token_ids: list[int]) -> str:
    """A prompt as text for `echo`.

    Its ids must already be checked, because an id past the vocabulary would make the
    tokenizer raise.
    """
    if isinstance(prompt, str):
        return prompt
    assert tokenizer is not None  # taken before the request started
    return tokenizer.decode(prompt_token_ids)


def _usage(runs: list[Run], completion_tokens: int) -> Usage:
    return Usage.of(sum(len(run.prompt_token_ids) for run in runs), completion_tokens,
                    sum(run.cached_tokens or 0 for run in runs))


async def _events(runs: list[Run], body: CompletionRequest, shapers: list[_ChoiceText]
                  ) -> AsyncIterator[bytes]:
    """The SSE stream.

    A choice's first chunk carries its echo, and with `return_token_ids` the prompt's ids.
    """
    first = runs[0]
    prompt_tokens = [len(run.prompt_token_ids) for run in runs for _ in run.choices]
    generated = [0] * len(prompt_tokens)  # tokens per choice
    try:
        async for index, step in interleave([c.steps for run in runs for c in run.choices]):
            choice = shapers[index].choice(index, step)
            generated[index] += 0 if body.echo_only else len(step.token_ids)
            if choice.text or step.finish_reason or choice.token_ids or choice.logprobs:
                usage = None  # vLLM's continuous_usage_stats: this choice's usage so far
                if body.continuous_usage:
                    usage = Usage.of(prompt_tokens[index], generated[index])
                yield event(Completion(first.id, first.created, first.model, [choice], usage))
    except GatewayError as exc:
        yield error_event(exc)
    else:
        if body.include_usage:
            usage = _usage(runs, sum(generated))
            yield event(Completion(first.id, first.created, first.model, [], usage))
    yield DONE


async def _start(serving: Serving, request: Request, body: CompletionRequest,
                 prompts: list[list[int]]) -> list[Run]:
    """Start one run per prompt, each with the request's n choices. All start, or none."""
    # A batch that cannot fit is refused before any of its requests starts.
    if len(prompts) > 1:
        serving.admission.check_room(len(prompts) * body.n, f"{len(prompts)} prompts x n={body.n}")
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
    """Continue a prompt, or each prompt of a batch, given as text or as token ids."""
    body = await serving.parse(request, CompletionRequest)
    prompts = body.prompts
    ids = [p if isinstance(p, list) else serving.tokenizer.encode(p, body.add_special_tokens)
           for p in prompts]
    # Echoing token ids needs the tokenizer, so without one this is a 400. It is checked
    # before any place is taken.
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
    usage = _usage(runs, 0 if body.echo_only else sum(len(out.token_ids) for out in outs))
    first = runs[0]
    return json_response(Completion(first.id, first.created, first.model, choices, usage))
