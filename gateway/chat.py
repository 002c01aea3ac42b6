"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError
from gateway.logprobs import chat_logprobs, prompt_logprobs
from gateway.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    Delta,
    Usage,
)
from gateway.output import Output
from gateway.serving import Run, Serving, client_gone, json_response
from gateway.sse import DONE, EventStreamResponse, error_event, event
from gateway.tokenizer import Tokenizer


def conversation(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template sees them."""
    messages = []
    for message in body.messages:
        turn: dict[str, Any] = {"role": message.role}
        # transformers drops None-valued keys before rendering; templates test for absence.
        if (text := message.text()) is not None:
            turn["content"] = text
        messages.append(turn)
    return messages


def _role(body: ChatCompletionRequest) -> str:
    """Whose turn the reply is (vLLM): the assistant's, or without a generation prompt the
    last message's role, whose turn it continues."""
    return "assistant" if body.add_generation_prompt else body.messages[-1].role


def _echoed(body: ChatCompletionRequest) -> str:
    """With vLLM's `echo`: the last message's content, when the reply continues its turn."""
    last = body.messages[-1]
    return (last.text() or "") if body.echo and last.role == _role(body) else ""


def _chunk(run: Run, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
    return event(ChatCompletionChunk(run.id, run.created, run.model, choices, usage))


def _namer(serving: Serving, body: ChatCompletionRequest) -> Tokenizer | None:
    """What names tokens in logprobs: None writes vLLM's `token_id:N`."""
    return None if body.return_tokens_as_token_ids else serving.maybe_tokenizer


def _logprobs(serving: Serving, body: ChatCompletionRequest, step: Output
              ) -> ChatLogprobs | None:
    if not body.logprobs or not step.token_ids:
        return None
    return chat_logprobs(_namer(serving, body), step.token_ids, step.logprobs)


async def _events(serving: Serving, run: Run, body: ChatCompletionRequest
                  ) -> AsyncIterator[bytes]:
    """The SSE stream: a role chunk per choice, content chunks, each choice's finish, maybe
    usage, then [DONE]."""
    generated = [0] * len(run.choices)  # tokens per choice

    def so_far(index: int) -> Usage | None:  # vLLM's continuous_usage_stats: per choice
        return run.usage(generated[index]) if body.continuous_usage else None

    for choice in run.choices:
        yield _chunk(run, [ChatChunkChoice(choice.index, Delta(role=_role(body), content=""),
                                           None)], so_far(choice.index))
    if echoed := _echoed(body):
        for choice in run.choices:
            yield _chunk(run, [ChatChunkChoice(choice.index, Delta(content=echoed), None)],
                         so_far(choice.index))
    try:
        async for index, step in run.stream():
            generated[index] += len(step.token_ids)
            logprobs = _logprobs(serving, body, step)
            if step.text or step.finish_reason or logprobs:
                delta = Delta(content=step.text or None)
                choice = ChatChunkChoice(index, delta, step.finish_reason, logprobs)
                if step.finish_reason is not None:
                    choice.stop_reason = step.stop_reason
                yield _chunk(run, [choice], so_far(index))
    except GatewayError as exc:
        yield error_event(exc)
    else:
        if body.include_usage:
            yield _chunk(run, [], run.usage(sum(generated)))
    yield DONE


async def create_chat_completion(serving: Serving, request: Request) -> Response:
    """Generate the assistant's reply to a conversation."""
    body = await serving.parse(request, ChatCompletionRequest)
    prompt_token_ids = serving.tokenizer.encode_chat(
        conversation(body), body.add_generation_prompt, body.template_kwargs(),
        body.continue_final_message, body.add_special_tokens)
    run = await serving.start(request, "chatcmpl", prompt_token_ids, body)
    if body.stream:
        return EventStreamResponse(_events(serving, run, body), run.aclose)
    outs = await serving.complete(request, run)
    if outs is None:
        return client_gone()
    echoed = _echoed(body)
    choices = [ChatChoice(i, AssistantMessage(echoed + out.text, _role(body)), out.finish_reason,
                          _logprobs(serving, body, out), out.stop_reason)
               for i, out in enumerate(outs)]
    usage = run.usage(sum(len(out.token_ids) for out in outs))
    scores = None
    if body.prompt_logprobs is not None and outs[0].prompt_logprobs is not None:
        scores = prompt_logprobs(_namer(serving, body), prompt_token_ids,
                                 outs[0].prompt_logprobs)
    return json_response(ChatCompletion(run.id, run.created, run.model, choices, usage,
                                        prompt_logprobs=scores))
