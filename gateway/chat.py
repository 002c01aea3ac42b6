"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError
from gateway.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Delta,
    Usage,
)
from gateway.serving import Run, Serving, client_gone, json_response
from gateway.sse import DONE, EventStreamResponse, error_event, event


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


def _chunk(run: Run, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
    return event(ChatCompletionChunk(run.id, run.created, run.model, choices, usage))


async def _events(run: Run, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE stream: a role chunk, content chunks, the finish, maybe usage, then [DONE]."""
    yield _chunk(run, [ChatChunkChoice(0, Delta(role="assistant", content=""), None)])
    completion_tokens = 0
    try:
        async for step in run.steps:
            completion_tokens += len(step.token_ids)
            if step.text or step.finish_reason:
                delta = Delta(content=step.text or None)
                yield _chunk(run, [ChatChunkChoice(0, delta, step.finish_reason)])
    except GatewayError as exc:
        yield error_event(exc)
    else:
        if include_usage:
            yield _chunk(run, [], run.usage(completion_tokens))
    yield DONE


async def create_chat_completion(serving: Serving, request: Request) -> Response:
    """Generate the assistant's reply to a conversation."""
    body = await serving.parse(request, ChatCompletionRequest)
    prompt_token_ids = serving.tokenizer.encode_chat(conversation(body))
    run = await serving.start(request, "chatcmpl", prompt_token_ids, body)
    if body.stream:
        return EventStreamResponse(_events(run, body.include_usage), run.generation.aclose)
    whole = await serving.complete(request, run)
    if whole is None:
        return client_gone()
    choice = ChatChoice(0, AssistantMessage(whole.text), whole.finish_reason)
    return json_response(
        ChatCompletion(run.id, run.created, run.model, [choice], run.usage(len(whole.token_ids)))
    )
