"""Tool calling: a chat request's `tools` and `tool_choice`, and the calls read back out of
the generated text, as vLLM serves them.

- a named function: the output is constrained to JSON the function's parameters accept,
  and all of it is that one call's arguments;
- "required": the output is constrained to a JSON array of {"name", "parameters"}
  objects, one per call;
- "auto": the model decides; the parser chosen with --tool-call-parser reads calls written
  in the model's own format out of its text (the server needs --enable-auto-tool-choice);
- "none": the tools are only shown to the chat template.

A parser reads text as it streams and returns, per piece, the content and the tool-call
deltas it makes; a whole response is the same deltas joined, so both agree by construction.
"""

from __future__ import annotations

import json
import random
import string
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
    """One entry of `tools` (its fields in the order clients send them, as the chat
    template writes them out)."""

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
    """A call in an assistant message (the response's, or one a client sends back)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    """What a streamed chunk adds to a call's function: the name once, arguments text."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """What a streamed chunk adds to call `index`: its id, type and name come first."""

    index: int
    function: FunctionDelta
    id: str | None = None
    type: Literal["function"] | None = None


def tool_list(tools: list[dict[str, Any]] | None) -> list[Tool] | None:
    """A request's `tools` as sent, checked and typed: a 400 naming `tools` where one is
    not a function tool."""
    try:
        return msgspec.convert(tools, list[Tool] | None)
    except msgspec.ValidationError as exc:
        raise bad_request(f"Invalid `tools`: {exc}", "tools") from None


def check_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> None:
    """vLLM's checks of `tools` against `tool_choice` (400s naming `tool_choice`)."""
    if tool_choice is None or tool_choice == "none":
        return
    if tools is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(tool_choice, NamedToolChoice) and \
            all(tool.function.name != tool_choice.function.name for tool in tools):
        raise bad_request("The tool specified in `tool_choice` does not match any of the "
                              "specified `tools`", "tool_choice")


def served_choice(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> ToolChoice:
    """`tool_choice` as served (vLLM's): "auto" when tools come without one, "none" when
    no tool is given."""
    if not tools:
        return "none"
    return "auto" if tool_choice is None else tool_choice


def _parameters(function: Function) -> dict[str, Any]:
    """The schema of a function's arguments (a function without one takes `{}`)."""
    return function.parameters or {"type": "object", "properties": {}}


def call_schema(tools: list[Tool] | None, tool_choice: ToolChoice | None
                ) -> dict[str, Any] | None:
    """The JSON schema the output must follow (vLLM's), or None: unconstrained."""
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
        # vLLM's, but closed: a call is its name and parameters, and a key besides them
        # (a sampled path may write one) would leave an object the parser cannot take
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
    """Reads tool calls out of one choice's text as it streams. `feed` each piece, then
    `finish` once; subclasses say how calls are written."""

    forced = False  # whether a grammar makes the model call (named, required)
    keeps_special_tokens = False  # whether it reads a special token (kept in the text)

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
        """The choice's finish reason, given the engine's (vLLM's: "tool_calls" when the
        model chose to call; see the subclasses)."""
        if self.calls and reason in ("stop", "length"):
            return "tool_calls"
        return reason

    def _whole(self, name: str, arguments: Any) -> ToolCallDelta:
        """A complete call as one delta; `arguments` as decoded JSON."""
        return self._start(name, json.dumps(arguments, ensure_ascii=False))

    def _start(self, name: str, arguments: str) -> ToolCallDelta:
        self.calls += 1
        return ToolCallDelta(self.calls - 1, FunctionDelta(name, arguments),
                             self._new_id(), "function")

    @staticmethod
    def call_id() -> str:
        """A new call's id, as the models this parser reads take them back."""
        return call_id()


class NamedCall(ToolParser):
    """A named tool choice: the whole text is the one call's arguments."""

    forced = True

    def __init__(self, name: str, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        self._name = name

    def feed(self, text: str) -> Parsed:
        if not text:
            return Parsed()
        if self.calls:
            return Parsed(calls=[ToolCallDelta(0, FunctionDelta(arguments=text))])
        return Parsed(calls=[self._start(self._name, text)])

    def finish(self) -> Parsed:  # a call even if nothing was generated
        return Parsed() if self.calls else Parsed(calls=[self._start(self._name, "")])

    def finish_reason(self, reason: str | None) -> str | None:
        return reason  # "stop", as OpenAI and vLLM end a named call


_DECODER = json.JSONDecoder()


class JsonArrayCalls(ToolParser):
    """Calls as a JSON array of {"name", KEY: arguments} objects; each call is sent once
    its object is complete."""

    def __init__(self, key: str, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        self._key = key
        self._text = ""
        self._done = 0  # characters of `_text` read

    def feed(self, text: str) -> Parsed:
        self._text += text
        parsed = Parsed()
        if "}" not in text:  # no object completed (decoding again would cost O(length))
            return parsed
        while (start := _skip(self._text, self._done, " \t\r\n[,")) < len(self._text):
            try:
                item, end = _DECODER.raw_decode(self._text, start)
            except (ValueError, RecursionError):
                break  # not complete yet (or nested too deep to read: content)
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                break  # not a call: left as content by `finish`
            parsed.calls.append(self._whole(item["name"], item.get(self._key, {})))
            self._done = end
        return parsed

    def finish(self) -> Parsed:
        """What followed the last complete call, unless only the array's end, is content
        (the output was cut short, say by max_tokens)."""
        rest = self._text[_skip(self._text, self._done, " \t\r\n,]"):]
        return Parsed(content=self._text[self._done:] if rest else "")


class RequiredCalls(JsonArrayCalls):
    """tool_choice "required": the array of {"name", "parameters"} its schema holds the
    output to."""

    forced = True

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__("parameters", new_id)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" else reason  # (vLLM's, calls or not)


class MistralCalls(JsonArrayCalls):
    """Calls as Mistral models (Mixtral 8x22B) write them: text, then the special token
    `[TOOL_CALLS]` and a JSON array of {"name", "arguments"}. Text before the token is
    content but for its trailing whitespace; calls get the 9-character alphanumeric ids
    Mistral's chat templates insist on when the conversation comes back."""

    TOKEN = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def __init__(self) -> None:
        super().__init__("arguments")
        self._before = ""  # text held before the token: a possible start of it, whitespace
        self._found = False

    def feed(self, text: str) -> Parsed:
        if self._found:
            return super().feed(text)
        self._before += text
        at = self._before.find(self.TOKEN)
        if at >= 0:
            self._found = True
            content, rest, self._before = self._before[:at].rstrip(), \
                self._before[at + len(self.TOKEN):], ""
            parsed = super().feed(rest)
            parsed.content = content
            return parsed
        keep = _partial_tag(self._before, self.TOKEN)
        content = self._before[:len(self._before) - keep]
        body = content.rstrip()  # whitespace waits: dropped if the token follows it
        self._before = content[len(body):] + self._before[len(self._before) - keep:]
        return Parsed(body)

    def finish(self) -> Parsed:
        if not self._found:
            held, self._before = self._before, ""
            return Parsed(held)
        parsed = super().finish()
        if not self.calls:  # no call after all: the text as written
            parsed.content = self.TOKEN + self._text
        return parsed

    @staticmethod
    def call_id() -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def _skip(text: str, start: int, chars: str) -> int:
    """The first index from `start` whose character is not one of `chars`."""
    while start < len(text) and text[start] in chars:
        start += 1
    return start


class HermesCalls(ToolParser):
    """Calls written as Hermes and Qwen models write them, between tags:
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. Text outside the
    tags is content, but for the whitespace around calls: where content follows calls
    that followed content, one run of it (the last, or else the first) still separates
    them. A tagged body that is not such a call stays content, tags and all."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._held = ""  # text not yet decided
        self._inside = False  # within a call's tags
        self._space = ""  # content's trailing whitespace, held to see what follows it
        self._gap = ""  # the whitespace that preceded the calls since the last content
        self._after_call = False  # whether calls came since the last content
        self._emitted = False  # whether any content was sent

    def feed(self, text: str) -> Parsed:
        seen = max(0, len(self._held) - len(self.END) + 1)  # searched before: no tag there
        self._held += text
        parsed = Parsed()
        while True:
            tag = self.END if self._inside else self.START
            at = self._held.find(tag, seen)
            if at < 0:
                break
            before, self._held, seen = self._held[:at], self._held[at + len(tag):], 0
            if self._inside:
                parsed += self._call(before)
            else:
                parsed.content += self._content(before)
            self._inside = not self._inside
        if not self._inside:  # all but a possible start of the tag is content
            keep = _partial_tag(self._held, self.START)
            parsed.content += self._content(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
        return parsed

    def finish(self) -> Parsed:
        """An unclosed call is a call if its body is one; then what is left is content."""
        if self._inside:
            parsed = self._call(self._held, closed=False)
        else:
            parsed = Parsed(content=self._content(self._held))
        self._held = ""
        if not self.calls:
            parsed.content += self._space
        return parsed

    def _content(self, text: str) -> str:
        """Content to send now; trailing whitespace waits to see what follows it."""
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        if body and self._after_call:
            rest = body.lstrip()
            separator = body[:len(body) - len(rest)] or self._gap
            body = separator + rest if self._emitted else rest
            self._after_call, self._gap = False, ""
        self._emitted = self._emitted or bool(body)
        return body

    def _call(self, body: str, closed: bool = True) -> Parsed:
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):  # (nested too deep to read: not a call)
            call = None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            text = self.START + body + (self.END if closed else "")
            return Parsed(content=self._content(text))
        if not self._after_call:
            self._gap = self._space
        self._space, self._after_call = "", True
        return Parsed(calls=[self._whole(call["name"], call.get("arguments", {}))])


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesCalls, "mistral": MistralCalls}


def check_auto(tools: list[Tool] | None, tool_choice: ToolChoice | None,
               auto_parser: str | None) -> None:
    """A 400 when the request asks for "auto" (maybe by leaving tool_choice out with
    tools) from a server without a parser for it; vLLM's check, run before any work."""
    asks = tool_choice == "auto" or (tool_choice is None and bool(tools))
    if asks and auto_parser is None:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                          "--tool-call-parser to be set", "tool_choice")


def parser_for(tools: list[Tool] | None, tool_choice: ToolChoice | None,
               parser: str | None, auto: bool) -> ToolParser | None:
    """A new parser for one choice's text, or None: the text is all content. `parser`: the
    server's --tool-call-parser, which also gives named and required calls its models'
    ids; `auto`: whether the server enables auto tool choice."""
    choice = served_choice(tools, tool_choice)
    new_id = TOOL_PARSERS[parser].call_id if parser is not None else None
    if isinstance(choice, NamedToolChoice):
        return NamedCall(choice.function.name, new_id)
    if choice == "required":
        return RequiredCalls(new_id)
    if choice == "none":
        return None
    check_auto(tools, tool_choice, parser if auto else None)
    assert parser is not None  # (checked)
    return TOOL_PARSERS[parser]()


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
