"""The JSON forms of a forced tool choice.

These are a named function's arguments, and the array of calls for "required". The array
form is also the base of Mistral's format.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from gateway.parsers.tool_calls import (
    FunctionDelta,
    Parsed,
    ToolCallDelta,
    ToolParser,
)


class NamedCall(ToolParser):
    """A named tool choice. The whole text is the one call's arguments."""

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

    def finish(self) -> Parsed:  # a call, even if nothing was generated
        return Parsed() if self.calls else Parsed(calls=[self._start(self._name, "")])

    def finish_reason(self, reason: str | None) -> str | None:
        return reason  # "stop", as OpenAI and vLLM end a named call


_DECODER = json.JSONDecoder()


class JsonArrayCalls(ToolParser):
    """Calls as a JSON array of {"name", KEY: arguments} objects.

    Each call is sent once its object is complete.
    """

    def __init__(self, key: str, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        self._key = key
        self._text = ""
        self._done = 0  # characters of `_text` read

    def feed(self, text: str) -> Parsed:
        self._text += text
        parsed = Parsed()
        if "}" not in text:  # no object completed; decoding again would cost O(length)
            return parsed
        while (start := _skip(self._text, self._done, " \t\r\n[,")) < len(self._text):
            try:
                item, end = _DECODER.raw_decode(self._text, start)
            except (ValueError, RecursionError):
                break  # not complete yet, or nested too deep to read and so content
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                break  # not a call; `finish` leaves it as content
            parsed.calls.append(self._whole(item["name"], item.get(self._key, {})))
            self._done = end
        return parsed

    def finish(self) -> Parsed:
        """Return what followed the last complete call as content.

        This is empty if only the array's end followed. Otherwise the output was cut short,
        for example by max_tokens.
        """
        rest = self._text[_skip(self._text, self._done, " \t\r\n,]"):]
        return Parsed(content=self._text[self._done:] if rest else "")


class RequiredCalls(JsonArrayCalls):
    """tool_choice "required", whose schema holds the output to an array of
    {"name", "parameters"} objects."""

    forced = True

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        super().__init__("parameters", new_id)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" else reason  # as vLLM does, with or without calls




def _skip(text: str, start: int, chars: str) -> int:
    """The first index from `start` whose character is not one of `chars`."""
    while start < len(text) and text[start] in chars:
        start += 1
    return start
