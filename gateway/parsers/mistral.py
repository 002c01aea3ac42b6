"""Mistral's tool calls, as in Mixtral 8x22B: `[TOOL_CALLS]` and a JSON array of calls."""

from __future__ import annotations

import random
import string

from gateway.parsers.json_calls import JsonArrayCalls
from gateway.parsers.tool_calls import (
    Parsed,
    partial_tag,
)


class MistralCalls(JsonArrayCalls):
    """Calls as Mistral models such as Mixtral 8x22B write them.

    The model writes text, then the special token `[TOOL_CALLS]` and a JSON array of
    {"name", "arguments"} objects. Text before the token is content, except for its
    trailing whitespace. Calls get 9-character alphanumeric ids, because Mistral's chat
    templates insist on them when the conversation comes back.
    """

    TOKEN = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def __init__(self) -> None:
        super().__init__("arguments")
        self._before = ""  # held text that may start the token, or whitespace
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
        keep = partial_tag(self._before, self.TOKEN)
        content = self._before[:len(self._before) - keep]
        body = content.rstrip()  # whitespace waits, and is dropped if the token follows
        self._before = content[len(body):] + self._before[len(self._before) - keep:]
        return Parsed(body)

    def finish(self) -> Parsed:
        if not self._found:
            held, self._before = self._before, ""
            return Parsed(held)
        parsed = super().finish()
        if not self.calls:  # no call after all, so keep the text as written
            parsed.content = self.TOKEN + self._text
        return parsed

    @staticmethod
    def call_id() -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))
