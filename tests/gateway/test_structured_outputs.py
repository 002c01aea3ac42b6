"""Structured outputs in the gateway: requests' constraints as llguidance grammars, and
their errors (the engine's side: tests/services/attention/test_grammar.py)."""

from __future__ import annotations

import json
import sys

import pytest

from gateway.errors import GatewayError
from gateway.parsers.structured_outputs import (
    JsonSchema,
    ResponseFormat,
    StructuredOutputs,
    grammar,
)
from services.attention.engine import Engine
from switchyard.demo_model import DEFAULT_MODEL


def refused(response_format: ResponseFormat | None, structured: StructuredOutputs | None
            ) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        grammar(response_format, structured)
    assert info.value.status == 400
    return info.value


def test_bad_constraints_are_the_requests_400() -> None:
    assert grammar(None, None) is None and grammar(ResponseFormat("text"), None) is None
    assert refused(ResponseFormat("json_schema"), None).param == "response_format"
    assert refused(ResponseFormat("json_schema", JsonSchema(schema={"type": "objectx"})),
                   None).param == "response_format"
    assert "one kind" in refused(None, StructuredOutputs(regex="a", choice=["b"])).message
    assert refused(ResponseFormat("json_object"), StructuredOutputs(regex="a")).param == \
        "structured_outputs"
    assert refused(None, StructuredOutputs(regex="[0-9")).param == "structured_outputs"
    assert refused(None, StructuredOutputs(choice=[])).param == "structured_outputs"
    assert refused(None, StructuredOutputs()).param == "structured_outputs"  # no constraint


def test_json_is_compact_unless_the_schema_asks_for_whitespace() -> None:
    def options(schema: dict) -> dict:
        built = json.loads(grammar(ResponseFormat("json_schema", JsonSchema(schema=schema)),
                                   None) or "")
        return built["grammars"][0]["json_schema"]["x-guidance"]

    assert options({"type": "object"}) == {"whitespace_flexible": False}
    assert options({"type": "object", "x-guidance": {"lenient": True}}) == \
        {"whitespace_flexible": False, "lenient": True}
    assert options({"x-guidance": {"whitespace_flexible": True}}) == \
        {"whitespace_flexible": True}


def test_without_llguidance_the_error_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails
    assert "`llguidance`" in refused(ResponseFormat("json_object"), None).message
    engine_side = Engine.__new__(Engine)  # only its grammars
    from services.attention.grammar import Grammars

    engine_side.grammars = Grammars(DEFAULT_MODEL, 261, (260,))
    assert "`llguidance`" in (engine_side.grammars.matcher("{}")[1] or "")










