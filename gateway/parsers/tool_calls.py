"""Tool calling, as vLLM serves it.

This covers a chat request's `tools` and `tool_choice`, and the calls read back out of the
generated text. The tool choices work as follows.

- A named function: the output is constrained to JSON that the function's parameters
  accept, and all of it is that one call's arguments.
- "required": the output is constrained to a JSON array of {"name", "parameters"}
  objects, one per call.
- "auto": the model decides. The parser chosen with --tool-call-parser reads calls
  written in the model's own format out of its text. The server needs
  --enable-auto-tool-choice for this.
- "none": the tools are only shown to the chat template.

A parser reads text as it streams. For each piece it returns the content and the
tool-call deltas that the piece makes. A whole response is the same deltas joined, so
streamed and whole responses agree by construction. This module holds the OpenAI tool
structs and the parsers' base class. Each model family's format has its own module
(`json_calls`, `hermes`, `mistral`), and `registry` names them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from gateway.errors import bad_request


class Function(msgspec.Struct, omit_defaults=True):
    """A tool's function: its name, and the JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    """One entry of `tools`.

    Its fields are in the order clients send them, which is how the chat template writes
    them out.
    """

    type: Literal["function"] = "function"
    function: Function


class FunctionName(msgspec.Struct):
    """The function a named tool choice calls."""

    name: str


class NamedToolChoice(msgspec.Struct):
    """`tool_choice` naming the function to call."""

    function: FunctionName
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct):
    """A call's function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    """A call in an assistant message, either in the response or sent back by a client."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    """What a streamed chunk adds to a call's function: the name once, then arguments text."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """What a streamed chunk adds to call `index`. Its id, type and name come first."""

    index: int
    function: FunctionDelta
    id: str | None = None
    type: Literal["function"] | None = None


def tool_list(tools: list[dict[str, Any]] | None) -> list[Tool] | None:
    """A request's `tools` as sent, checked and typed.

    Raises a 400 naming `tools` where an entry is not a function tool.
    """
    try:
        return msgspec.convert(tools, list[Tool] | None)
    except msgspec.ValidationError as exc:
        raise bad_request(f"Invalid `tools`: {exc}", "tools") from None


def check_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> None:
    """vLLM's checks of `tools` against `tool_choice`. Failures are 400s naming
    `tool_choice`."""
    if tool_choice is None or tool_choice == "none":
        return
    if tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(tool_choice, NamedToolChoice) and \
            all(tool.function.name != tool_choice.function.name for tool in tools):
        raise bad_request("The tool specified in `tool_choice` does not match any of the "
                              "specified `tools`", "tool_choice")


def served_choice(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> ToolChoice:
    """`tool_choice` as served, following vLLM.

    It is "auto" when tools come without a tool choice, and "none" when no tool is given.
    """
    if not tools:
        return "none"
    return "auto" if tool_choice is None else tool_choice


def _parameters(function: Function) -> dict[str, Any]:
    """The schema of a function's arguments. A function without a schema takes `{}`."""
    return function.parameters or {"type": "object", "properties": {}}


def call_schema(tools: list[Tool] | None, tool_choice: ToolChoice | None
                ) -> dict[str, Any] | None:
    """The JSON schema the output must follow, as in vLLM, or None if unconstrained."""
    choice = served_choice(tools, tool_choice)
    if isinstance(choice, NamedToolChoice):
        return next(_parameters(t.function) for t in tools or []
                    if t.function.name == choice.function.name)
    if choice != "required":
        return None
    calls, defs = [], {}  # each tool's $defs move to the top, where references find them
    for tool in tools or []:
        parameters = dict(_parameters(tool.function))
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise bad_request(f"Tool definition '{name}' has multiple schemas, which is "
                                  "not supported.", "tools")
        # This is vLLM's schema, but closed. A call is its name and parameters. Any other
        # key, which a sampled path might write, would leave an object the parser cannot
        # take.
        calls.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    return {**schema, "$defs": defs} if defs else schema


def call_id() -> str:
    """A new call's id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class Parsed:
    """What a piece of generated text makes: message content, and tool-call deltas."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


class ToolParser:
    """Reads tool calls out of one choice's text as it streams.

    Call `feed` with each piece, then `finish` once. Subclasses define how calls are
    written.
    """

    forced = False  # whether a grammar forces calls, for named or required choices
    keeps_special_tokens = False  # whether it reads a special token, which must stay in the text

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        self.calls = 0  # calls started so far
        self._new_id = new_id or self.call_id  # (another model family's ids)

    def feed(self, text: str) -> Parsed:
        """The content and calls that `text`, the next piece of the output, completes."""
        raise NotImplementedError

    def finish(self) -> Parsed:
        """What is still held once the output has ended."""
        return Parsed()

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish reason, given the engine's.

        As in vLLM, it is "tool_calls" when the model chose to call. See the subclasses.
        """
        if self.calls and reason in ("stop", "length"):
            return "tool_calls"
        return reason

    def _whole(self, name: str, arguments: Any) -> ToolCallDelta:
        """A complete call as one delta. `arguments` is decoded JSON."""
        return self._start(name, json.dumps(arguments, ensure_ascii=False))

    def _start(self, name: str, arguments: str) -> ToolCallDelta:
        self.calls += 1
        return ToolCallDelta(self.calls - 1, FunctionDelta(name, arguments),
                             self._new_id(), "function")

    @staticmethod
    def call_id() -> str:
        """A new call's id, in the form that the models this parser reads take back."""
        return call_id()


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass
class Collected:
    """A whole choice's parsed text: its content and its complete calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, parsed: Parsed) -> None:
        self.content += parsed.content
        for delta in parsed.calls:
            if delta.id is not None:
                self.calls.append(ToolCall(id=delta.id, function=FunctionCall(
                    delta.function.name or "", delta.function.arguments or "")))
            else:
                call = self.calls[delta.index].function
                call.arguments += delta.function.arguments or ""


def collect(parser: ToolParser, text: str) -> Collected:
    """A whole text, parsed."""
    whole = Collected()
    whole.add(parser.feed(text))
    whole.add(parser.finish())
    return whole
