"""OpenAI API bodies as msgspec Structs, with the vLLM extensions we support.

Requests ignore unknown fields, like the OpenAI and vLLM servers do. The field constraints
here are the validation, and msgspec's error messages become 400 responses.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Annotated, Any, Literal

import msgspec

from gateway.errors import bad_request
from gateway.parsers.structured_outputs import ResponseFormat, StructuredOutputs, grammar
from gateway.parsers.tool_calls import (
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    call_schema,
    check_tools,
    tool_list,
)

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Temperature = Annotated[float, msgspec.Meta(ge=0)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]  # OpenAI's range
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
NumLogprobs = Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)]
MAX_N = 128


def _never(value: Any) -> bool:
    return False


def _empty(value: Any) -> bool:
    return value in ("", [], {}, False)


# Fields of OpenAI's API or vLLM's that would change the output and are not built here.
# Ignoring them, as unknown fields are, would answer 200 with output other than asked for,
# so each is refused unless its value changes nothing. Each entry holds a test for a
# harmless value and a description of what the field asks for.
NOT_BUILT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "structural_tag": (_never, "structural tags"),
    # Chat completions take both of these.
    "tools": (_empty, "tool calling, which chat completions serve"),
    "tool_choice": (lambda v: v in ("none", "auto"), "tool calling, which chat completions serve"),
    "functions": (_empty, "function calling"),
    "function_call": (lambda v: v in ("none", "auto"), "function calling"),
    "bad_words": (_empty, "bad_words"),
    "suffix": (_empty, "suffix"),
    "use_beam_search": (_empty, "beam search"),
    "best_of": (lambda v: v == 1, "best_of"),
    "logits_processors": (_empty, "logits_processors"),
    "chat_template": (_empty, "a chat template of its own (vLLM: --trust-request-chat-template)"),
}


def refuse_not_built(raw: dict[str, Any], known: Collection[str]) -> None:
    """Refuse with a 400 the first field of `raw` that asks for something not built.

    `raw` is a request body with its nulls dropped. `known` holds the fields that the
    request struct itself takes; those are not refused.
    """
    for name, value in raw.items():
        if name in NOT_BUILT and name not in known and not NOT_BUILT[name][0](value):
            raise bad_request(f"`{name}` is not supported by this server: it asks for "
                              f"{NOT_BUILT[name][1]}.", name)


class StreamOptions(msgspec.Struct):
    """`stream_options`: whether a final chunk reports token usage, and whether every
    chunk reports the usage so far, which is a vLLM extension."""

    include_usage: bool | msgspec.UnsetType = msgspec.UNSET
    continuous_usage_stats: bool | msgspec.UnsetType = msgspec.UNSET

    def given(self) -> bool:
        """Whether any option is set. vLLM refuses options without `stream`, but not `{}`."""
        return self.include_usage is not msgspec.UNSET or \
            self.continuous_usage_stats is not msgspec.UNSET


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and text completion requests."""

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1)] | None = None  # -1 or 0 means no top-k
    min_p: Probability | None = None
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None
    # vLLM extensions. min_tokens: no EOS, stop token or stop string before this many
    # generated tokens. include_stop_str_in_output: keep the stop string at the end of the
    # text. skip_special_tokens: whether special tokens are left out of the text.
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM extension: each prompt token's log-probability and this many alternatives
    prompt_logprobs: NumLogprobs | None = None
    # OpenAI's: maps a token id to a bias added to its logit. The id is a string because
    # JSON keys are strings.
    logit_bias: dict[str, Annotated[float, msgspec.Meta(ge=-100, le=100)]] | None = None
    # vLLM extension: sample only among these tokens
    allowed_token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]],
                                 msgspec.Meta(min_length=1)] | None = None
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs name tokens `token_id:N`
    # vLLM extension: keep only the prompt's last k tokens. -1 keeps as many as the model
    # takes.
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and the
    # guided_* fields that older vLLM took. See gateway/parsers/structured_outputs.py.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM extension: only requests with the same salt share prefix-cached KV. This keeps
    # tenants apart.
    cache_salt: Annotated[str, msgspec.Meta(min_length=1)] | None = None

    def __post_init__(self) -> None:
        if self.stream_options is not None and self.stream_options.given() \
                and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        if self.stream and self.prompt_logprobs:  # vLLM accepts 0 here too
            raise bad_request("`prompt_logprobs` are not available when `stream=True`.",
                              "prompt_logprobs")

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list, without empty strings, which could never be found."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives to report per token, or None when no logprobs were asked for."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Alternatives to report per prompt token, or None for no prompt logprobs."""
        return self.prompt_logprobs

    @property
    def prompt_scored_per_choice(self) -> bool:
        """Whether every choice carries the prompt's log-probabilities.

        Text completions carry them in each choice's echoed logprobs and `prompt_logprobs`.
        """
        return True

    def grammar(self) -> str | None:
        """The llguidance grammar the output must follow, if the request constrains it."""
        structured = self.structured_outputs
        legacy = StructuredOutputs(self.guided_json, self.guided_regex, self.guided_choice,
                                   self.guided_grammar)
        if legacy != StructuredOutputs():
            if structured is not None:
                raise bad_request("Use `structured_outputs` or the guided_* fields, not "
                                  "both.", "structured_outputs")
            structured = legacy
        return grammar(self.response_format, structured, self.tool_schema())

    def tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema that a named or required tool choice holds the output to.

        Only chat completions have one.
        """
        return None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage is True

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far.

        As in vLLM, this needs include_usage too.
        """
        return self.include_usage and self.stream_options is not None and \
            self.stream_options.continuous_usage_stats is True


class ContentPart(msgspec.Struct):
    """One element of a message's list-form content. Only text parts are supported."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    """One conversation turn as the client sent it.

    An assistant turn may hold the tool calls it made. A tool turn answers one of them.
    """

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str | None:
        """The content as one string. Text parts are joined by newlines, as vLLM does."""
        if not isinstance(self.content, list):
            return self.content
        if any(part.type != "text" or part.text is None for part in self.content):
            raise bad_request("Only text content parts are supported.", "messages")
        return "\n".join(part.text or "" for part in self.content)


# chat_template_kwargs may set any template variable except these. As in vLLM, that
# includes add_generation_prompt, tools and documents. The conversation is always the
# request's `messages`. vLLM refuses the other two because they are arguments of
# apply_chat_template itself.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "chat_template", "tokenize"})


def check_rendering(kwargs: dict[str, Any] | None, add_generation_prompt: bool,
                    continue_final_message: bool) -> None:
    """Refuse what chat completions and /tokenize do not allow in rendering a conversation."""
    if continue_final_message and add_generation_prompt:
        raise bad_request("Cannot set both `continue_final_message` and "
                          "`add_generation_prompt` to True.", "continue_final_message")
    if kwargs and (taken := sorted(RESERVED_TEMPLATE_VARIABLES & kwargs.keys())):
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}")


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True  # vLLM: end the prompt with the assistant's header
    continue_final_message: bool = False  # vLLM: the reply continues the last message
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: the template's variables
    echo: bool = False  # vLLM: the reply starts with the last message's content, in its turn
    add_special_tokens: bool = False  # vLLM: the template writes them, and true adds a BOS
    # Tools are shown to the template as sent, as transformers shows them. The model calls
    # them as tool_choice says. See gateway/parsers/tool_calls.py.
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    documents: list[dict[str, str]] | None = None  # vLLM: for RAG templates

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        check_tools(self.tool_list(), self.tool_choice)
        check_rendering(self.chat_template_kwargs, self.add_generation_prompt,
                        self.continue_final_message)

    def template_kwargs(self) -> dict[str, Any]:
        """The template's variables: tools and documents, then `chat_template_kwargs`."""
        given = {"tools": self.tools, "documents": self.documents}
        return {**{k: v for k, v in given.items() if v is not None},
                **(self.chat_template_kwargs or {})}

    def tool_schema(self) -> dict[str, Any] | None:
        return call_schema(self.tool_list(), self.tool_choice)

    def tool_list(self) -> list[Tool] | None:
        """`tools`, checked. A 400 names the field where an entry is not a tool."""
        return tool_list(self.tools)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Only a whole response carries prompt logprobs.

        As in vLLM, 0 is accepted with `stream`.
        """
        return None if self.stream else self.prompt_logprobs

    @property
    def prompt_scored_per_choice(self) -> bool:
        """The response has a single `prompt_logprobs`, scored by choice 0's engine request."""
        return False


TokenId = Annotated[int, msgspec.Meta(ge=0)]
# msgspec takes one array type per union, so `prompt` decodes a superset of what is
# accepted, and `prompts` refuses the rest. /openapi.json states what is accepted.
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
PROMPT_SCHEMA = {"anyOf": [{"type": "string"}, _IDS,
                           {"type": "array", "items": {"type": "string"}},
                           {"type": "array", "items": _IDS}]}


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions.

    `prompt` is text or token ids, or a batch of either. As in OpenAI and vLLM, choice
    `i * n + j` is choice j of prompt i.
    """

    prompt: str | list[TokenId | str | list[TokenId]]
    # 0 with `echo` returns only the prompt, with its log-probabilities if `logprobs` is set
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    add_special_tokens: bool = True  # such as the BOS a Llama tokenizer prepends to a text
    return_token_ids: bool = False
    echo: bool = False
    logprobs: NumLogprobs | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1, got 0 (0 needs `echo`).",
                              "max_tokens")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str) or all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            return p  # type: ignore[return-value]
        raise bad_request("A prompt is a string or a list of token ids, and a batch is a "
                          "list of strings or a list of token-id lists, not a mix.", "prompt")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        """As in vLLM and OpenAI, `echo` with `logprobs` scores the echoed prompt too."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        """Whether this is `echo` with `max_tokens` 0, which returns the prompt alone."""
        return self.echo and self.max_tokens == 0


class TopLogprob(msgspec.Struct):
    """One likely token at a position, as in chat `top_logprobs` entries."""

    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct):
    """The generated token at one position, and the likeliest alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    """A chat choice's `logprobs`."""

    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    """A text completion choice's `logprobs`, in the legacy completions shape."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(msgspec.Struct):
    """One token's entry at a prompt position, in vLLM's `prompt_logprobs` shape."""

    logprob: float
    rank: int
    decoded_token: str


# One item per prompt position. The first is None. Each other one maps token ids to
# entries, for the prompt's own token and the likeliest alternatives.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(msgspec.Struct, omit_defaults=True):
    """Token counts of one request.

    `prompt_tokens_details` is shaped as in vLLM. It appears only with
    --enable-prompt-tokens-details, once some prompt tokens were cached.
    """

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int,
           cached_tokens: int | None = None) -> Usage:
        details = PromptTokensDetails(cached_tokens) if cached_tokens else None
        return cls(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                   details)


class AssistantMessage(msgspec.Struct):
    """The generated turn of a non-streamed chat completion."""

    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class ChatChoice(msgspec.Struct):
    """A non-streamed chat completion choice."""

    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    stop_reason: int | str | None = None  # vLLM: the stop token id or string that ended it


class ChatCompletion(msgspec.Struct):
    """Non-streamed chat completion response."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    prompt_logprobs: PromptLogprobs | None = None  # vLLM: present with `prompt_logprobs`


class Delta(msgspec.Struct, omit_defaults=True):
    """What a chat chunk adds to the message. As in OpenAI, absent fields are omitted."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct):
    """A streamed chat completion choice."""

    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    stop_reason: int | str | msgspec.UnsetType | None = msgspec.UNSET  # on the last chunk


class ChatCompletionChunk(msgspec.Struct):
    """One SSE event of a streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionChoice(msgspec.Struct, omit_defaults=True):
    """A text completion choice. Token id fields appear only with `return_token_ids`."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None
    stop_reason: int | str | None  # vLLM: the stop token id or string that ended it
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM: present when asked for


class Completion(msgspec.Struct):
    """A text completion response, or one streamed chunk of it, with `usage` None."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    object: Literal["text_completion"] = "text_completion"


class ModelCard(msgspec.Struct):
    """One entry of GET /v1/models."""

    id: str
    created: int
    max_model_len: int | None
    root: str
    quantization: str | None = None  # "w4a4" when the experts serve in MXFP4
    owned_by: str = "switchyard"
    parent: str | None = None
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct):
    """GET /v1/models."""

    data: list[ModelCard]
    object: Literal["list"] = "list"
