"""The engine samples only what a request's grammar allows (llguidance matchers over the
demo model's tokenizer), with speculation too (drafts the grammar forbids cut, each
position verified under its own mask), and refuses alone a grammar it cannot match."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client import REGISTRY

from common.messages import GenerateRequest, SamplingParams
from gateway.parsers.structured_outputs import (
    JsonSchema,
    ResponseFormat,
    StructuredOutputs,
    grammar,
)
from gateway.text.tokenizer import Tokenizer
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine
from services.attention.spec_decode.config import parse_speculative_config
from switchyard.demo_model import DEFAULT_MODEL

SPECULATION = [None, '{"method": "mtp", "num_speculative_tokens": 3}',
               '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}']


@pytest.fixture(scope="module", params=SPECULATION, ids=["off", "mtp", "ngram"])
def demo_engine(request: pytest.FixtureRequest) -> Engine:
    return build_engine(AttentionConfig(
        model=DEFAULT_MODEL, max_num_batched_tokens=64,
        speculative=parse_speculative_config(request.param)))


def generate(engine: Engine, constraint: str, n: int = 4, max_tokens: int = 40
             ) -> list[tuple[str, str | None]]:
    """(text, finish reason) of a greedy and n - 1 sampled answers to a demo question."""
    tok = Tokenizer.load(DEFAULT_MODEL)
    assert tok is not None
    prompt = tok.encode_chat([{"role": "user", "content": "What is 123 + 456?"}])
    for i in range(n):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if i == 0 else 1.5,
                                seed=i, grammar=constraint)
        assert engine.add(GenerateRequest(f"r{i}", prompt, params)) is None
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str | None] = {}
    while engine.has_work():
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            reasons[d.request_id] = d.finish_reason
    return [(tok.decode(tokens[f"r{i}"]), reasons[f"r{i}"]) for i in range(n)]


def _drafts() -> float:
    return REGISTRY.get_sample_value("switchyard:spec_decode_num_drafts_total") or 0.0


def test_the_engine_samples_only_what_the_grammar_allows(demo_engine: Engine) -> None:
    """The model answers "579" unconstrained; each constraint holds greedy and at
    temperature 1.5, and a complete grammar ends the answer."""
    before = _drafts()
    for text, reason in generate(demo_engine, grammar(None, StructuredOutputs(
            regex=r"[0-9]{2}-[a-z]"))):
        assert re.fullmatch(r"[0-9]{2}-[a-z]", text) and reason == "stop", text
    choices = ["yes", "no", "57"]
    for text, reason in generate(demo_engine, grammar(None, StructuredOutputs(
            choice=choices))):
        assert text in choices and reason == "stop", text
    for text, reason in generate(demo_engine, grammar(ResponseFormat(
            "json_schema", JsonSchema(schema=SCHEMA)), None)):
        value = json.loads(text)  # compact: no whitespace the schema does not ask for
        assert set(value) == {"answer", "sure"} and len(value["answer"]) <= 4, text
        assert isinstance(value["sure"], bool) and " " not in text and reason == "stop"
    for text, _ in generate(demo_engine, grammar(ResponseFormat("json_object"), None),
                            n=2, max_tokens=12):
        assert text.startswith("{")  # (12 tokens may end before the object does)
    if demo_engine.speculator is not None:  # and it did speculate under the grammars
        assert _drafts() > before


def test_a_grammar_the_engine_cannot_match_is_refused_alone(demo_engine: Engine,
                                                           qwen3_ckpt: tuple) -> None:
    """Sent to the attention service directly: an error delta, not a failed step; a
    model without a tokenizer says so."""
    bad = demo_engine.add(GenerateRequest("bad", [1, 2], SamplingParams(grammar="%%% x")))
    assert bad is not None and bad.finish_reason == "error" and "structured" in bad.error
    tiny = build_engine(AttentionConfig(model=qwen3_ckpt[0]))
    none = tiny.add(GenerateRequest("t", [1, 2], SamplingParams(
        grammar=grammar(ResponseFormat("json_object"), None))))
    assert none is not None and "tokenizer" in (none.error or "")


def test_a_tokenizer_wider_than_the_model_eos_rules_and_impossible_constraints(
        qwen3_ckpt: tuple, tmp_path: object) -> None:
    """The tiny model (256 logits, EOS 255) with the demo tokenizer (261 tokens): masks as
    wide as the logits; a complete grammar ends the answer with ignore_eos and min_tokens
    too; a constraint nothing satisfies (allowed_token_ids outside the grammar) is that
    request's error, not a forbidden token."""
    import shutil
    from pathlib import Path

    model = Path(str(tmp_path)) / "tiny-with-tokenizer"
    shutil.copytree(qwen3_ckpt[0], model)
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", model / "tokenizer.json")
    tok = Tokenizer.load(DEFAULT_MODEL)
    assert tok is not None
    engine = build_engine(AttentionConfig(model=model))
    digits = grammar(None, StructuredOutputs(regex="[0-9]{3}"))
    letter = tok.encode("a", add_special_tokens=False)
    asks = {"plain": SamplingParams(max_tokens=10, seed=1, grammar=digits),
            "eos ignored": SamplingParams(max_tokens=10, seed=2, grammar=digits,
                                          ignore_eos=True, min_tokens=6),
            "impossible": SamplingParams(max_tokens=10, seed=3, grammar=digits,
                                         allowed_token_ids=tuple(letter))}
    for name, params in asks.items():
        assert engine.add(GenerateRequest(name, [1, 2, 3], params)) is None
    tokens: dict[str, list[int]] = {}
    ends: dict[str, tuple[str | None, str | None]] = {}
    while engine.has_work():
        for d in engine.step():
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            ends[d.request_id] = (d.finish_reason, d.error)
    for name in ("plain", "eos ignored"):
        assert re.fullmatch("[0-9]{3}", tok.decode(tokens[name])), tokens[name]
        assert ends[name] == ("stop", None)
    reason, error = ends["impossible"]
    assert reason == "error" and "structured outputs" in (error or "")


SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 4},
                                           "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
