"""POST /v1/chat/completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.logprobs import chat_logprobs, prompt_logprobs
from gateway.api.output import Output
from gateway.api.protocol import (
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
from gateway.api.serving import Run, Serving, client_gone, json_response
from gateway.api.sse import DONE, EventStreamResponse, error_event, event
from gateway.errors import GatewayError
from gateway.parsers.registry import parser_for
from gateway.parsers.tool_calls import Parsed, ToolParser, collect
from gateway.text.tokenizer import Tokenizer


def conversation(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template sees them."""
    messages = []
    for message in body.messages:
        turn: dict[str, Any] = {"role": message.role}
        # transformers drops None-valued keys before rendering. Templates test for absence.
        if (text := message.text()) is not None:
            turn["content"] = text
        # Templates write the arguments with `tojson`, so they are decoded, as vLLM does.
        if message.tool_calls:
            turn["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": _decoded(call.function.arguments)}}
                for call in message.tool_calls]
        for key in ("tool_call_id", "name"):
            if (value := getattr(message, key)) is not None:
                turn[key] = value
        messages.append(turn)
    return messages


def _decoded(arguments: str) -> dict[str, Any] | list[Any]:
    """A call's arguments as JSON values.

    As in vLLM, arguments that are not a JSON object or array become `{}`.
    """
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict | list) else {}


def _role(body: ChatCompletionRequest) -> str:
    """The role whose turn the reply is, as in vLLM.

    This is the assistant's turn. Without a generation prompt, the reply continues the
    last message's turn, so it takes that message's role.
    """
    return "assistant" if body.add_generation_prompt else body.messages[-1].role


def _echoed(body: ChatCompletionRequest) -> str:
    """The text that vLLM's `echo` puts first in the reply.

    This is the last message's content when the reply continues that message's turn, and
    "" otherwise.
    """
    last = body.messages[-1]
    return (last.text() or "") if body.echo and last.role == _role(body) else ""


def _chunk(run: Run, choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
    return event(ChatCompletionChunk(run.id, run.created, run.model, choices, usage))


def _namer(serving: Serving, body: ChatCompletionRequest) -> Tokenizer | None:
    """The tokenizer that names tokens in logprobs. None writes vLLM's `token_id:N`."""
    return None if body.return_tokens_as_token_ids else serving.maybe_tokenizer


def _logprobs(serving: Serving, body: ChatCompletionRequest, step: Output
              ) -> ChatLogprobs | None:
    if not body.logprobs or not step.token_ids:
        return None
    return chat_logprobs(_namer(serving, body), step.token_ids, step.logprobs)


async def _events(serving: Serving, run: Run, body: ChatCompletionRequest
                  ) -> AsyncIterator[bytes]:
    """The SSE stream.

    It sends a role chunk per choice, then content chunks, then each choice's finish, and
    maybe usage. It ends with [DONE].
    """
    generated = [0] * len(run.choices)  # tokens per choice
    parsers = [_parser(serving, body) for _ in run.choices]

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
            parsed = _parse(parsers[index], step)
            if parsed.content or parsed.calls or step.finish_reason or logprobs:
                delta = Delta(content=parsed.content or None, tool_calls=parsed.calls or None)
                reason = _finish_reason(parsers[index], step.finish_reason)
                choice = ChatChunkChoice(index, delta, reason, logprobs)
                if step.finish_reason is not None:
                    choice.stop_reason = step.stop_reason
                yield _chunk(run, [choice], so_far(index))
    except GatewayError as exc:
        yield error_event(exc)
    else:
        if body.include_usage:
            yield _chunk(run, [], run.usage(sum(generated)))
    yield DONE


def _parser(serving: Serving, body: ChatCompletionRequest) -> ToolParser | None:
    """A new reader of tool calls for one choice, or None when its text is all content."""
    config = serving.config
    return parser_for(body.tool_list(), body.tool_choice, config.tool_call_parser,
                      config.enable_auto_tool_choice)


def _finish_reason(parser: ToolParser | None, reason: str | None) -> str | None:
    return reason if parser is None else parser.finish_reason(reason)


def _parse(parser: ToolParser | None, step: Output) -> Parsed:
    """A step's text as content and tool calls."""
    if parser is None:
        return Parsed(step.text)
    parsed = parser.feed(step.text)
    if step.finish_reason is not None:
        parsed += parser.finish()
    return parsed


def _choice(serving: Serving, body: ChatCompletionRequest, index: int, out: Output
            ) -> ChatChoice:
    """A whole choice: its turn's content after any echo, its tool calls, and why it ended."""
    parser = _parser(serving, body)
    text, calls = out.text, []
    if parser is not None:
        whole = collect(parser, out.text)
        text, calls = whole.content, whole.calls
    content: str | None = _echoed(body) + text
    if not content and calls and parser is not None and not parser.forced:
        content = None  # as vLLM does for calls the model chose to make
    return ChatChoice(index, AssistantMessage(content, _role(body), calls),
                      _finish_reason(parser, out.finish_reason),
                      _logprobs(serving, body, out), out.stop_reason)


async def create_chat_completion(serving: Serving, request: Request) -> Response:
    """Generate the assistant's reply to a conversation."""
    body = await serving.parse(request, ChatCompletionRequest)
    # A first parser refuses "auto" without the server's parser before any work starts.
    if (parser := _parser(serving, body)) is not None and parser.keeps_special_tokens:
        body.skip_special_tokens = False  # as in vLLM, the parser must see its token
    prompt_token_ids = serving.tokenizer.encode_chat(
        conversation(body), body.add_generation_prompt, body.template_kwargs(),
        body.continue_final_message, body.add_special_tokens)
    run = await serving.start(request, "chatcmpl", prompt_token_ids, body)
    if body.stream:
        return EventStreamResponse(_events(serving, run, body), run.aclose)
    outs = await serving.complete(request, run)
    if outs is None:
        return client_gone()
    choices = [_choice(serving, body, i, out) for i, out in enumerate(outs)]
    usage = run.usage(sum(len(out.token_ids) for out in outs))
    scores = None
    if body.prompt_logprobs is not None and outs[0].prompt_logprobs is not None:
        scores = prompt_logprobs(_namer(serving, body), prompt_token_ids,
                                 outs[0].prompt_logprobs)
    return json_response(ChatCompletion(run.id, run.created, run.model, choices, usage,
                                        prompt_logprobs=scores))
