"""POST /tokenize and POST /detokenize, vLLM's extensions, with vLLM's body shapes.

/tokenize takes a text `prompt` or a chat `messages` list. A conversation is rendered
exactly as /v1/chat/completions renders it, so `count` equals that request's prompt_tokens.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.chat import conversation
from gateway.api.protocol import ChatCompletionRequest, ChatMessage, check_rendering
from gateway.api.serving import Serving, json_response
from gateway.errors import bad_request, engine_unavailable
from gateway.text.tokenizer import Tokenizer

TokenId = Annotated[int, msgspec.Meta(ge=0)]


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: either a text `prompt` or a chat `messages` list, vLLM's two shapes.

    One Struct rather than a union of two, because msgspec tells Struct types apart only by
    a tag field, which vLLM's bodies do not have. `add_special_tokens` defaults to true for
    a prompt, for example to add the BOS a Llama tokenizer prepends. It defaults to false
    for a conversation, whose chat template writes the special tokens itself.
    """

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # shown to the template, as chat does
    documents: list[dict[str, str]] | None = None
    return_token_strs: bool = False

    def __post_init__(self) -> None:
        check_rendering(self.chat_template_kwargs, self.add_generation_prompt,
                        self.continue_final_message)


class TokenizeResponse(msgspec.Struct):
    """Token ids of the prompt. `max_model_len` is None until the engine describes itself."""

    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(msgspec.Struct):
    """The text of the tokens, with special tokens included, as vLLM decodes them."""

    prompt: str


def _prompt_text(tokenizer: Tokenizer, body: TokenizeRequest) -> str:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("Give exactly one of `prompt` (text) and `messages` (a conversation).",
                          "prompt")
    if body.prompt is not None:
        return body.prompt
    # The very rendering /v1/chat/completions uses, so the counts agree.
    chat = ChatCompletionRequest(messages=body.messages, tools=body.tools, tool_choice="none",
                                 documents=body.documents,
                                 chat_template_kwargs=body.chat_template_kwargs)
    return tokenizer.render_chat(conversation(chat), body.add_generation_prompt,
                                 chat.template_kwargs(), body.continue_final_message)


async def tokenize(serving: Serving, request: Request) -> Response:
    """POST /tokenize."""
    body = await serving.parse(request, TokenizeRequest)
    tokenizer = serving.tokenizer
    text = _prompt_text(tokenizer, body)
    add_special_tokens = body.add_special_tokens
    if add_special_tokens is None:
        add_special_tokens = body.prompt is not None
    ids = tokenizer.encode(text, add_special_tokens)
    strs = [tokenizer.backend.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    max_model_len = serving.max_model_len(serving.engine.info)
    return json_response(TokenizeResponse(len(ids), max_model_len, ids, strs))


async def detokenize(serving: Serving, request: Request) -> Response:
    """POST /detokenize. Ids the model could never produce are a 400, as in prompts."""
    body = await serving.parse(request, DetokenizeRequest)
    tokenizer = serving.tokenizer
    info = serving.engine.info
    if info is None:
        raise engine_unavailable("not connected to the engine yet")
    if body.tokens and (bad := max(body.tokens)) >= info.vocab_size:
        raise bad_request(f"Token id {bad} is out of vocabulary (size {info.vocab_size}).",
                          "tokens")
    return json_response(DetokenizeResponse(tokenizer.decode(body.tokens,
                                                             skip_special_tokens=False)))
