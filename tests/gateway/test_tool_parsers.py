"""Tool calling's parts: the schemas a tool choice holds the output to, and the parsers that
read calls back out of text, checked against Qwen3's own chat template (the format is the
model's, not ours) and against any split of the text into streamed pieces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from gateway.api.chat import conversation
from gateway.api.protocol import ChatCompletionRequest
from gateway.config import parse_args
from gateway.errors import GatewayError
from gateway.parsers.hermes import HermesCalls
from gateway.parsers.json_calls import NamedCall, RequiredCalls
from gateway.parsers.mistral import MistralCalls
from gateway.parsers.registry import check_auto, parser_for
from gateway.parsers.structured_outputs import grammar
from gateway.parsers.tool_calls import Collected, ToolParser, collect
from gateway.text.tokenizer import Tokenizer
from switchyard.compose import Layout, render
from switchyard.demo_model import DEFAULT_MODEL
from tests.support import DATA
from tests.support.gateway import QWEN3_TEMPLATE, TIME, WEATHER


def template_model(out: Path, template: Path = QWEN3_TEMPLATE) -> Path:
    """The bundled model's files with a model maker's chat template (Qwen3's unless
    told)."""
    shutil.copytree(DEFAULT_MODEL, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template.read_text()
    config_path.write_text(json.dumps(config))
    return out


def request(**fields: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields},
                           ChatCompletionRequest)


def refused(**fields: Any) -> GatewayError:
    with pytest.raises((GatewayError, msgspec.ValidationError)) as info:
        body = request(**fields)
        body.grammar()
    assert not isinstance(info.value, GatewayError) or info.value.status == 400
    return info.value  # type: ignore[return-value]


def test_tool_choice_is_checked_against_the_tools_as_vllm_does() -> None:
    assert "`tools` must be set" in str(refused(tool_choice="required"))
    assert "does not match any" in str(refused(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_time"}}))
    assert "tool_choice" in str(refused(tools=[WEATHER], tool_choice="sometimes"))
    assert refused(tools=[{"type": "function", "function": {}}]).param == "tools"
    # Served as "none": required with no tools (vLLM, OpenAI), auto without any
    for body in (request(tools=[], tool_choice="required"), request(tools=[],
                                                                    tool_choice="auto")):
        assert body.grammar() is None
        assert parser_for(body.tool_list(), body.tool_choice, "hermes", True) is None
    # "auto", also by default with tools, needs a parser on the server (vLLM's check)
    tools = request(tools=[WEATHER]).tool_list()
    for asked in ((tools, None), (tools, "auto"), ([], "auto")):
        with pytest.raises(GatewayError, match="--enable-auto-tool-choice"):
            check_auto(*asked, None)
        check_auto(*asked, "hermes")
    check_auto([], None, None)  # no tools, no choice: nothing asked
    assert isinstance(parser_for(tools, None, "hermes", True), HermesCalls)
    with pytest.raises(GatewayError, match="--enable-auto-tool-choice"):
        parser_for(tools, None, "hermes", False)
    # a named or required call takes the server's model family's ids (Mistral: 9 alnum)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for parser, length in ((None, 46), ("hermes", 46), ("mistral", 9)):
        for choice in (named, "required"):
            body = request(tools=[WEATHER], tool_choice=choice)
            reader = parser_for(body.tool_list(), body.tool_choice, parser, False)
            assert reader is not None
            text = '{"city": "x"}' if choice == named else \
                '[{"name": "get_weather", "parameters": {"city": "x"}}]'
            [call] = collect(reader, text).calls
            assert len(call.id) == length, (parser, choice, call.id)


def test_named_and_required_choices_constrain_as_vllm_does() -> None:
    body = request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                       "function": {"name": "get_weather"}})
    assert body.tool_schema() == WEATHER["function"]["parameters"]
    assert request(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}}).tool_schema() == \
        {"type": "object", "properties": {}}  # a function without parameters takes {}
    required = request(tools=[WEATHER, TIME], tool_choice="required").tool_schema()
    assert required is not None and required["type"] == "array" and required["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]] == \
        [["get_weather"], ["get_time"]]
    assert all(c["additionalProperties"] is False for c in required["items"]["anyOf"])
    for built in (body, request(tools=[WEATHER, TIME], tool_choice="required")):
        assert built.grammar() is not None  # llguidance builds it
    # a response_format besides is one constraint too many
    assert refused(tools=[WEATHER], tool_choice="required",
                   response_format={"type": "json_object"}).param == "tool_choice"


def test_required_schemas_definitions_move_to_the_top_and_must_agree() -> None:
    def tool(name: str, unit: list[str]) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"unit": {"$ref": "#/$defs/unit"}},
            "$defs": {"unit": {"enum": unit}}}}}

    body = request(tools=[tool("a", ["C", "F"]), tool("b", ["C", "F"])],
                   tool_choice="required")
    schema = body.tool_schema()
    assert schema is not None and schema["$defs"] == {"unit": {"enum": ["C", "F"]}}
    assert all("$defs" not in c["properties"]["parameters"]
               for c in schema["items"]["anyOf"])
    assert body.grammar() is not None
    assert "multiple schemas" in refused(tools=[tool("a", ["C"]), tool("b", ["F"])],
                                         tool_choice="required").message


def calls_of(whole: Collected) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in whole.calls]


def streamed(parser: ToolParser, text: str, cuts: list[int]) -> Collected:
    """`text` fed in pieces cut at `cuts`, then finished."""
    whole, start = Collected(), 0
    for end in [*sorted(cuts), len(text)]:
        whole.add(parser.feed(text[start:end]))
        start = max(start, end)
    whole.add(parser.finish())
    return whole


def same(a: Collected, b: Collected) -> bool:
    """Equal but for the calls' random ids."""
    return a.content == b.content and \
        [(c.function.name, c.function.arguments) for c in a.calls] == \
        [(c.function.name, c.function.arguments) for c in b.calls]


def test_hermes_reads_back_the_calls_qwen3s_template_writes(tmp_path: Path) -> None:
    """An assistant turn with content and two calls, rendered by transformers with Qwen3's
    template: its text, as the model would generate it, parses back to the same calls."""
    tokenizer = AutoTokenizer.from_pretrained(str(template_model(tmp_path / "m")))
    calls = [("get_weather", {"city": "Paris", "days": [1, 2]}),
             ("get_time", {"zone": "Europe/Paris", "note": "été"})]
    messages = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": f"call{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)]},
        {"role": "tool", "tool_call_id": "call0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call1", "content": "noon"},
        {"role": "user", "content": "Thanks"}]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER, TIME], tokenize=False)
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert turn.count("<tool_call>") == 2  # what the model writes
    whole = collect(HermesCalls(), turn)
    assert whole.content == "Let me check." and calls_of(whole) == calls
    assert same(streamed(HermesCalls(), turn, list(range(len(turn)))), whole)  # per char
    # with nothing but calls, the content is empty (vLLM: null)
    only = turn[turn.index("<tool_call>"):]
    assert collect(HermesCalls(), only).content == "" and calls_of(collect(HermesCalls(),
                                                                           only)) == calls


def test_hermes_keeps_what_is_not_a_call_as_content() -> None:
    for text in ("2 < 3 and <tool_ is not a tag", "<tool_call>\n{not json}\n</tool_call> x",
                 '<tool_call>{"arguments": {}}</tool_call>', "ends in a tag start <tool_ca",
                 "  spaced out  \n"):
        whole = collect(HermesCalls(), text)
        assert whole.content == text and whole.calls == []
    # an unclosed call at the end is a call if its body is one, else content
    whole = collect(HermesCalls(), 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}')
    assert whole.content == "Hi" and calls_of(whole) == [("f", {"a": 1})]
    assert collect(HermesCalls(), "Hi <tool_call>{\"name\": ").content == \
        "Hi <tool_call>{\"name\": "
    # text after calls is content too; whitespace that only separates it from calls is not
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for text, content in ((f"{call}\n\nDone.\n", "Done."),
                          (f"I'll check.\n\n{call}\n{call}\n\nThen compare.",
                           "I'll check.\n\nThen compare."),  # (the last run separates)
                          (f"Hi {call}bye", "Hi bye"),  # (else the first)
                          (f"Hi{call}bye", "Hibye"), (f" \n{call} ", "")):
        whole = collect(HermesCalls(), text)
        assert whole.content == content and calls_of(whole) == [("f", {})] * \
            text.count("<tool_call>"), text
    # JSON nested too deep for Python's decoder is not a call: content, not a crash
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    assert collect(HermesCalls(), deep).content == deep
    deep = "[" * 100_000
    assert collect(RequiredCalls(), deep).content == deep


WORDS = st.text(alphabet=st.sampled_from(list("ab.<>")), min_size=1, max_size=6).filter(
    lambda w: "<tool_call>" not in w)
SPACE = st.text(alphabet=st.sampled_from([" ", "\n"]), max_size=3)


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.tuples(SPACE, st.integers(0, 2), SPACE, WORDS), min_size=1,
                      max_size=4), first=WORDS)
def test_hermes_content_keeps_one_separator_where_calls_were(
        parts: list[tuple[str, int, str, str]], first: str) -> None:
    """Content, then groups of calls each followed by more content: the content is the
    words with one whitespace run where each group was (the one after it, else the one
    before it), and the calls are all of them, in order."""
    call = '<tool_call>\n{"name": "f", "arguments": {"i": %d}}\n</tool_call>'
    text, content, expected, i = first, first, [], 0
    for before, calls, after, words in parts:
        group = "".join(call % (i + k) for k in range(calls))
        expected += [("f", {"i": i + k}) for k in range(calls)]
        i += calls
        text += before + group + after + words
        content += (after or before if calls else before + after) + words
    whole = collect(HermesCalls(), text)
    assert whole.content == content and calls_of(whole) == expected


PIECES = st.lists(st.one_of(
    st.text(alphabet=st.sampled_from(list("ab <>/_{}\"\n:tolcal")), max_size=12),
    st.sampled_from(["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"x": 1}}',
                     "\n", '{"name": "g"}'])), max_size=10)


@settings(max_examples=300, deadline=None)
@given(pieces=PIECES, data=st.data())
def test_any_text_parses_the_same_streamed_in_any_pieces(pieces: list[str],
                                                         data: st.DataObject) -> None:
    """Whatever the text, and wherever the stream cuts it, the content and calls are
    those of the whole text; no character is lost unless it is part of a call or the
    whitespace separating one."""
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    whole = collect(HermesCalls(), text)
    assert same(streamed(HermesCalls(), text, cuts), whole)
    if not whole.calls:
        assert whole.content == text


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["get_weather", "get_time"]),
                                st.dictionaries(st.text(max_size=5), st.integers()
                                                | st.text(max_size=5), max_size=3)),
                      min_size=1, max_size=3),
       indent=st.sampled_from([None, 1]), data=st.data())
def test_required_calls_are_read_as_each_completes(calls: list[tuple[str, dict]],
                                                   indent: int | None,
                                                   data: st.DataObject) -> None:
    text = json.dumps([{"name": n, "parameters": p} for n, p in calls], indent=indent)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    whole = streamed(RequiredCalls(), text, cuts)
    assert calls_of(whole) == calls and whole.content == ""
    # cut short (max_tokens): the complete calls, and the rest as content
    cut = text[:-3]
    short = collect(RequiredCalls(), cut)
    assert calls_of(short) == calls[:-1] and cut.endswith(short.content) and short.content


def test_a_named_call_is_all_the_text_and_never_tool_calls_finished() -> None:
    named = NamedCall("get_weather")
    whole = streamed(named, '{"city": "Paris"}', [3, 5, 9])
    assert calls_of(whole) == [("get_weather", {"city": "Paris"})] and whole.content == ""
    assert named.finish_reason("stop") == "stop"  # OpenAI and vLLM: a named call stops
    required = RequiredCalls()
    collect(required, '[{"name": "f", "parameters": {}}]')
    assert required.finish_reason("stop") == "tool_calls"
    assert required.finish_reason("length") == "length"
    auto = HermesCalls()  # (vLLM's: calls made, however the output ended)
    assert auto.finish_reason("stop") == "stop"
    collect(auto, '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then')
    assert auto.finish_reason("length") == auto.finish_reason("stop") == "tool_calls"
    assert auto.finish_reason("abort") == "abort"
    empty = collect(NamedCall("f"), "")  # nothing generated: still the call, empty
    assert [(c.function.name, c.function.arguments) for c in empty.calls] == [("f", "")]


def test_grammar_of_a_tool_choice_is_checked_by_llguidance() -> None:
    bad = {"type": "object", "properties": {"x": {"type": "nonsense"}}}
    with pytest.raises(GatewayError) as info:
        grammar(None, None, bad)
    assert info.value.param == "tool_choice"


def test_auto_tool_choice_is_configured_by_flags_or_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's two flags, or compose's SWITCHYARD_ variables (which reach the gateway)."""
    base = ["--model", str(DEFAULT_MODEL), "--engine", "127.0.0.1:1"]

    def tools(*flags: str) -> tuple[str | None, bool]:
        config = parse_args([*base, *flags])
        return config.tool_call_parser, config.enable_auto_tool_choice

    assert tools() == (None, False)
    assert tools("--tool-call-parser", "hermes") == ("hermes", False)
    assert tools("--enable-auto-tool-choice", "--tool-call-parser", "hermes") == \
        ("hermes", True)
    for bad in (["--enable-auto-tool-choice"], ["--tool-call-parser", "nope"]):
        with pytest.raises(SystemExit):
            parse_args([*base, *bad])
    monkeypatch.setenv("SWITCHYARD_ENABLE_AUTO_TOOL_CHOICE", "true")
    monkeypatch.setenv("SWITCHYARD_TOOL_CALL_PARSER", "hermes")
    assert tools() == ("hermes", True)
    monkeypatch.setenv("SWITCHYARD_TOOL_CALL_PARSER", "nope")  # unchecked by argparse
    with pytest.raises(SystemExit):
        parse_args(base)
    services = render(Layout())["services"]
    for name in ("gateway", "cpu"):
        assert {"SWITCHYARD_ENABLE_AUTO_TOOL_CHOICE", "SWITCHYARD_TOOL_CALL_PARSER"} <= \
            services[name]["environment"].keys()


def test_calls_sent_back_reach_the_template_with_arguments_decoded_as_vllm_does() -> None:
    def turn(arguments: str) -> dict[str, Any]:
        body = request(messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "42"}])
        turns = conversation(body)
        assert turns[2] == {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}
        assert "content" not in turns[1]  # (None: absent, as transformers passes it)
        return turns[1]["tool_calls"][0]["function"]["arguments"]

    assert turn('{"a": [1, 2]}') == {"a": [1, 2]}
    for bad in ("not json", "42", "[" * 100_000):  # (nested too deep: no crash)
        assert turn(bad) == {}
    assert turn("[1]") == [1]


MISTRAL_PIECES = st.lists(st.one_of(
    st.text(alphabet=st.sampled_from(list("ab [],{}\"\n:TOLCS_")), max_size=12),
    st.sampled_from(["[TOOL_CALLS]", " [", '{"name": "f", "arguments": {"x": 1}}', ", ",
                     "]", '{"name": "g"}'])), max_size=10)


@settings(max_examples=300, deadline=None)
@given(pieces=MISTRAL_PIECES, data=st.data())
def test_mistral_text_parses_the_same_streamed_in_any_pieces(pieces: list[str],
                                                             data: st.DataObject) -> None:
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    whole = collect(MistralCalls(), text)
    assert same(streamed(MistralCalls(), text, cuts), whole)
    if not whole.calls:  # nothing lost but whitespace before a token that led nowhere
        assert whole.content == text or whole.content.replace(" ", "").replace("\n", "") \
            == text.replace(" ", "").replace("\n", "")


def test_mistral_calls_after_the_token_and_content_before_it() -> None:
    text = 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", ' \
           '"arguments": {}}]'
    whole = collect(MistralCalls(), text)
    assert whole.content == "Sure." and calls_of(whole) == [("f", {"a": 1}), ("g", {})]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in whole.calls)
    assert same(streamed(MistralCalls(), text, list(range(len(text)))), whole)
    for plain in ("no calls [TOOL_ at all ", "[TOOL_CALLS] not json"):
        assert collect(MistralCalls(), plain).content == plain  # as written
    parser = MistralCalls()
    collect(parser, text)
    assert parser.finish_reason("stop") == "tool_calls"


MISTRAL_TEMPLATE = DATA / "mistral_v3_chat_template.jinja"


def test_mistral_reads_back_the_calls_mistrals_template_writes_and_its_ids_go_back(
        tmp_path: Path) -> None:
    """Mistral's v3 tool template (Mistral-7B-Instruct-v0.3's; Mixtral 8x22B writes
    calls the same way), rendered by transformers: the assistant's calls, as the model
    would generate them, parse back; the ids we make are ones the template takes back."""
    model = template_model(tmp_path / "m", MISTRAL_TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    calls = [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})]
    messages = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "tool_calls": [
            {"id": f"call{i}abcd", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)]},
        {"role": "tool", "tool_call_id": "call0abcd", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call1abcd", "content": "noon"},
        {"role": "assistant", "content": "Sunny at noon."},
        {"role": "user", "content": "Thanks"}]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER, TIME], tokenize=False)
    eos = tokenizer.eos_token
    turn = text.split("[/INST]")[1].split(eos)[0]
    assert turn.startswith("[TOOL_CALLS] [")  # what the model writes
    whole = collect(MistralCalls(), turn)
    assert whole.content == "" and calls_of(whole) == calls
    # the calls come back in the next request: our ids pass the template's check
    ours = Tokenizer.load(model)
    assert ours is not None
    back = request(messages=[messages[0], {"role": "assistant", "tool_calls": [
        msgspec.to_builtins(call) for call in whole.calls]}, {
        "role": "tool", "tool_call_id": whole.calls[0].id, "content": "sunny"}],
        tools=[WEATHER, TIME], tool_choice="none")
    assert whole.calls[0].id in ours.render_chat(conversation(back),
                                                 template_kwargs=back.template_kwargs())
    vllm_style = request(messages=[messages[0], {"role": "assistant", "tool_calls": [
        {"id": "chatcmpl-tool-0123", "type": "function", "function": {
            "name": "get_time", "arguments": "{}"}}]}])
    with pytest.raises(GatewayError, match="length 9"):
        ours.render_chat(conversation(vllm_style))
