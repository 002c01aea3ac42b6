"""The tool-call parsers by name, for `--tool-call-parser`, and the parser that a
request's tool choice needs."""

from __future__ import annotations

from gateway.errors import bad_request
from gateway.parsers.hermes import HermesCalls
from gateway.parsers.json_calls import NamedCall, RequiredCalls
from gateway.parsers.mistral import MistralCalls
from gateway.parsers.tool_calls import (
    NamedToolChoice,
    Tool,
    ToolChoice,
    ToolParser,
    served_choice,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesCalls, "mistral": MistralCalls}


def check_auto(tools: list[Tool] | None, tool_choice: ToolChoice | None,
               auto_parser: str | None) -> None:
    """Raise a 400 when the request asks for "auto" from a server without a parser for it.

    A request may ask for "auto" by leaving tool_choice out while giving tools. This is
    vLLM's check, and it runs before any work.
    """
    asks = tool_choice == "auto" or (tool_choice is None and bool(tools))
    if asks and auto_parser is None:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                          "--tool-call-parser to be set", "tool_choice")


def parser_for(tools: list[Tool] | None, tool_choice: ToolChoice | None,
               parser: str | None, auto: bool) -> ToolParser | None:
    """A new parser for one choice's text, or None when the text is all content.

    `parser` is the server's --tool-call-parser. It also gives named and required calls
    ids in the form its models use. `auto` says whether the server enables auto tool
    choice.
    """
    choice = served_choice(tools, tool_choice)
    new_id = TOOL_PARSERS[parser].call_id if parser is not None else None
    if isinstance(choice, NamedToolChoice):
        return NamedCall(choice.function.name, new_id)
    if choice == "required":
        return RequiredCalls(new_id)
    if choice == "none":
        return None
    check_auto(tools, tool_choice, parser if auto else None)
    assert parser is not None  # checked by check_auto
    return TOOL_PARSERS[parser]()
