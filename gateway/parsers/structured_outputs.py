"""Structured outputs as one llguidance grammar.

A request asks for structured output with OpenAI's `response_format`, or with vLLM's
`structured_outputs` or `guided_*` fields. The engine enforces the grammar token by token,
in services/attention/grammar.py.

Grammars are built and checked here, so a bad schema or regex makes the request a 400. The
engine only matches them against its tokenizer.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from gateway.errors import bad_request


class JsonSchema(msgspec.Struct):
    """`response_format.json_schema`: the schema, and OpenAI's name for it."""

    name: str = "response"
    schema: dict[str, Any] | bool = True  # a missing schema allows any JSON value
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: one constraint of these kinds.

    vLLM's other kinds, such as `structural_tag` or `whitespace_pattern`, are not built
    here, so they are refused.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or llama.cpp's GBNF
    json_object: bool | None = None


def grammar(response_format: ResponseFormat | None, structured: StructuredOutputs | None,
            tool_schema: dict[str, Any] | None = None) -> str | None:
    """The llguidance grammar asked for, checked, or None if none is asked for.

    Raises a 400 naming the field when the grammar cannot be built, or when more than one
    constraint is given. `tool_schema` is what a tool choice holds the output to; see
    gateway/parsers/tool_calls.py.
    """
    kinds: list[tuple[str, str, str]] = []  # (field, llguidance format, text)
    if response_format is not None and response_format.type == "json_object":
        kinds.append(("response_format", "json_schema", _compact({"type": "object"})))
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise bad_request("response_format of type json_schema needs `json_schema`.",
                              "response_format")
        kinds.append(("response_format", "json_schema",
                      _compact(response_format.json_schema.schema)))
    if structured is not None:
        given = {name: value for name in StructuredOutputs.__struct_fields__
                 if (value := getattr(structured, name)) is not None}
        if not given:
            raise bad_request("structured_outputs needs a constraint: json, regex, choice, "
                              "grammar or json_object.", "structured_outputs")
        kinds += [("structured_outputs", *_vllm_kind(name, value))
                  for name, value in given.items() if name != "json_object" or value]
    if tool_schema is not None:
        kinds.append(("tool_choice", "json_schema", _compact(tool_schema)))
    if not kinds:
        return None
    if len(kinds) > 1:
        raise bad_request("You can only use one kind of structured outputs constraint, "
                          f"got {len(kinds)}.", kinds[1][0])
    field, kind, text = kinds[0]
    llguidance = _llguidance()
    try:
        built = llguidance.grammar_from(kind, text)
        error = llguidance.LLMatcher.validate_grammar(built)
    except (ValueError, RuntimeError) as exc:
        error = str(exc)
    if error:
        raise bad_request(f"Invalid structured outputs constraint: {error}", field)
    return built


def _compact(schema: dict[str, Any] | bool | str) -> str:
    """A JSON schema's text, asking llguidance for JSON without optional whitespace.

    The exception is a schema whose `x-guidance` sets `whitespace_flexible`. Small models
    given the choice can fill a whole reply with whitespace.
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return str(schema)  # llguidance says what is wrong with it
    if isinstance(schema, dict):
        options = schema.get("x-guidance")
        options = options if isinstance(options, dict) else {}
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, **options}}
    return json.dumps(schema)


def _vllm_kind(name: str, value: Any) -> tuple[str, str]:
    if name == "json":
        return "json_schema", _compact(value)
    if name == "choice":
        if not value:
            raise bad_request("structured_outputs.choice needs at least one choice.",
                              "structured_outputs")
        return "choice", json.dumps(value)
    if name == "json_object":
        return "json_schema", _compact({"type": "object"})
    return {"regex": "regex", "grammar": "grammar"}[name], value


def _llguidance() -> Any:  # the optional module
    try:
        import llguidance
    except ImportError:
        raise bad_request("Structured outputs need the `llguidance` package on the gateway "
                          "(pip install llguidance).", "response_format") from None
    return llguidance
