"""Hermes' and Qwen's tool calls: JSON objects between `<tool_call>` tags."""

from __future__ import annotations

import json

from gateway.parsers.tool_calls import (
    Parsed,
    ToolParser,
    partial_tag,
)


class HermesCalls(ToolParser):
    """Calls written as Hermes and Qwen models write them, between tags.

    A call looks like `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
    Text outside the tags is content, except for the whitespace around calls. Where content
    follows calls that followed content, one run of that whitespace still separates the
    two pieces of content. It is the last run, or else the first. A tagged body that is not
    such a call stays content, tags and all.
    """

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._held = ""  # text not yet decided
        self._inside = False  # within a call's tags
        self._space = ""  # content's trailing whitespace, held to see what follows it
        self._gap = ""  # the whitespace before the calls made since the last content
        self._after_call = False  # whether calls came since the last content
        self._emitted = False  # whether any content was sent

    def feed(self, text: str) -> Parsed:
        # This part was searched before and holds no tag.
        seen = max(0, len(self._held) - len(self.END) + 1)
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
            keep = partial_tag(self._held, self.START)
            parsed.content += self._content(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
        return parsed

    def finish(self) -> Parsed:
        """An unclosed call counts as a call if its body is one. What is left is content."""
        if self._inside:
            parsed = self._call(self._held, closed=False)
        else:
            parsed = Parsed(content=self._content(self._held))
        self._held = ""
        if not self.calls:
            parsed.content += self._space
        return parsed

    def _content(self, text: str) -> str:
        """Content to send now. Trailing whitespace waits to see what follows it."""
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
        except (ValueError, RecursionError):  # nested too deep to read, so not a call
            call = None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            text = self.START + body + (self.END if closed else "")
            return Parsed(content=self._content(text))
        if not self._after_call:
            self._gap = self._space
        self._space, self._after_call = "", True
        return Parsed(calls=[self._whole(call["name"], call.get("arguments", {}))])
