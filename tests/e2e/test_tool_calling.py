"""Tool calling through the official `openai` client against `switchyard serve` as real
processes: a tiny Qwen3-MoE with the bundled byte tokenizer and Qwen3's own chat template,
served with `--enable-auto-tool-choice --tool-call-parser hermes`."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from switchyard.demo_model import DEFAULT_MODEL
from switchyard.serve_process import Served
from tests.support.checkpoints import build, qwen3_moe_config
from tests.support.gateway import QWEN3_TEMPLATE, TIME, WEATHER
from tests.support.serving import client, model_id

pytestmark = pytest.mark.timeout(300)
CITY = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY: dict[str, Any] = dict(temperature=0, max_tokens=120)
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": null}'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights over the bundled model's 261-token byte vocabulary, with room for
    the tools Qwen3's template writes into the prompt."""
    out = tmp_path_factory.mktemp("qwen3-tools")
    build(qwen3_moe_config(vocab_size=261, max_position_embeddings=2048, eos_token_id=260,
                           bos_token_id=256, pad_token_id=256), out)
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", out)
    config = json.loads((DEFAULT_MODEL / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_TEMPLATE.read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module", params=[[], ["--speculative-config", NGRAM]],
                ids=["plain", "speculating"])
def served(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[Served]:
    """Each test twice: without speculation, and with n-gram drafts (a call's JSON
    repeats itself; a named or required call's grammar cuts the drafts it forbids)."""
    with Served(["--model", str(model_dir), "--enable-auto-tool-choice",
                 "--tool-call-parser", "hermes", *request.param]) as s:
        yield s


def streamed_calls(chunks: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish reason) of choice 0, assembled from deltas as
    OpenAI's clients do: by call index, the id and name once, the arguments in pieces."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.index not in calls and delta.type == "function"
                    calls[delta.index] = [delta.function.name, ""]
                calls[delta.index][1] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason  # type: ignore[misc]


def whole_calls(choice: Any) -> list[tuple[str, str]]:
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    return [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def check_weather(arguments: str) -> None:
    """What CITY's schema allows, and nothing else."""
    args = json.loads(arguments)
    assert set(args) == {"city", "days"} and isinstance(args["city"], str)
    assert len(args["city"]) <= 8 and 1 <= args["days"] <= 7


def test_a_named_tool_choice_calls_that_function_with_arguments_its_schema_allows(
        served: Served) -> None:
    c, m = client(served), model_id(served)
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = c.chat.completions.create(model=m, messages=ASK, tools=[CITY, TIME],
                                      tool_choice=named, **GREEDY)
    choice = whole.choices[0]
    [(name, arguments)] = whole_calls(choice)
    assert name == "get_weather" and choice.message.content == ""
    check_weather(arguments)
    assert choice.finish_reason == "stop"  # as OpenAI and vLLM finish a named call
    stream = c.chat.completions.create(model=m, messages=ASK, tools=[CITY, TIME],
                                       tool_choice=named, stream=True, **GREEDY)
    assert streamed_calls(stream) == ("", [(name, arguments)], "stop")


def test_required_makes_calls_among_the_tools_each_with_its_arguments(served: Served) -> None:
    c, m = client(served), model_id(served)
    whole = c.chat.completions.create(model=m, messages=ASK, tools=[CITY, TIME],
                                      tool_choice="required", max_tokens=200, n=3, seed=1,
                                      temperature=1.0)
    for choice in whole.choices:
        calls = whole_calls(choice)
        assert calls  # (the first fits in far fewer tokens)
        if choice.finish_reason == "tool_calls":  # the array ended: all of it is calls
            assert choice.message.content == ""
        else:  # cut short: the complete calls, the rest as content
            assert choice.finish_reason == "length"
        for name, arguments in calls:
            assert name in ("get_weather", "get_time")
            if name == "get_weather":
                check_weather(arguments)
            else:
                assert json.loads(arguments) == {}  # its schema: an object, no properties
    stream = c.chat.completions.create(model=m, messages=ASK, tools=[CITY, TIME],
                                       tool_choice="required", max_tokens=200, n=3, seed=1,
                                       temperature=1.0, stream=True)
    chunks = list(stream)  # each choice parsed on its own, as in the whole response
    for choice in whole.choices:
        mine = [chunk.model_copy(update={"choices": [
            c for c in chunk.choices if c.index == choice.index]}) for chunk in chunks]
        assert streamed_calls(mine) == (choice.message.content, whole_calls(choice),
                                        choice.finish_reason)
    greedy = c.chat.completions.create(model=m, messages=ASK, tools=[CITY, TIME],
                                       tool_choice="required", **GREEDY)
    stream = c.chat.completions.create(model=m, messages=ASK, tools=[CITY, TIME],
                                       tool_choice="required", stream=True, **GREEDY)
    content, calls, reason = streamed_calls(stream)
    assert calls == whole_calls(greedy.choices[0]) and calls
    assert (content, reason) == (greedy.choices[0].message.content,
                                 greedy.choices[0].finish_reason)


HERMES_CALL = (r'I will look\.\n\n<tool_call>\n\{"name": "get_weather", "arguments": '
               r'\{"city": "[A-Z][a-z]{1,6}", "days": [1-7]\}\}\n</tool_call>')


def test_auto_reads_calls_the_model_writes_in_its_format(served: Served) -> None:
    """The model is held by a regex to write one call as Qwen3 does; "auto" (the default
    with tools) returns it as a call, the text before it as content."""
    c, m = client(served), model_id(served)
    forced = {**GREEDY, "extra_body": {"structured_outputs": {"regex": HERMES_CALL}}}
    whole = c.chat.completions.create(model=m, messages=ASK, tools=[CITY, TIME], **forced)
    choice = whole.choices[0]
    [(name, arguments)] = whole_calls(choice)
    assert name == "get_weather" and choice.message.content == "I will look."
    check_weather(arguments)
    assert choice.finish_reason == "tool_calls"
    stream = c.chat.completions.create(model=m, messages=ASK, tools=[CITY, TIME],
                                       tool_choice="auto", stream=True, **forced)
    assert streamed_calls(stream) == ("I will look.", [(name, arguments)], "tool_calls")
    # the same reply without tools to call: the text as it is
    raw = c.chat.completions.create(model=m, messages=ASK, **forced).choices[0]
    assert raw.message.tool_calls in (None, []) and raw.finish_reason == "stop"
    assert raw.message.content.startswith("I will look.\n\n<tool_call>\n{")


def test_auto_calls_cut_short_and_streamed_with_logprobs(served: Served) -> None:
    """A call, then text that max_tokens cuts: still "tool_calls" (vLLM's), the text
    after the call is content; logprobs cover every token, held-back text or not."""
    c, m = client(served), model_id(served)
    forced = {"temperature": 0, "max_tokens": 140, "logprobs": True, "extra_body": {
        "structured_outputs": {"regex": HERMES_CALL + r"\n\nNext, [a-z]{200}"}}}
    whole = c.chat.completions.create(model=m, messages=ASK, tools=[CITY], **forced)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and len(whole_calls(choice)) == 1
    assert choice.message.content.startswith("I will look.\n\nNext, ")
    assert len(choice.logprobs.content) == whole.usage.completion_tokens == 140
    chunks = list(c.chat.completions.create(model=m, messages=ASK, tools=[CITY],
                                            stream=True, **forced))
    assert streamed_calls(chunks) == (choice.message.content, whole_calls(choice),
                                      "tool_calls")
    streamed = [entry for chunk in chunks for ch in chunk.choices if ch.logprobs
                for entry in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]


def test_auto_without_a_call_is_the_text_as_with_tools_not_called(served: Served) -> None:
    c, m = client(served), model_id(served)
    plain = c.chat.completions.create(model=m, messages=ASK, tools=[CITY], tool_choice="none",
                                      **GREEDY).choices[0]
    auto = c.chat.completions.create(model=m, messages=ASK, tools=[CITY], **GREEDY).choices[0]
    assert "<tool_call>" not in plain.message.content  # (a random model: it did not call)
    assert auto.message.content == plain.message.content and not auto.message.tool_calls
    assert auto.finish_reason == plain.finish_reason


def test_a_conversation_with_calls_and_results_is_rendered_as_transformers_does(
        served: Served, model_dir: Path) -> None:
    """The calls an assistant made and the tools' answers go back to the template, the
    arguments as JSON values (as vLLM passes them), and prompt as transformers writes it."""
    c, m = client(served), model_id(served)
    call = {"id": "call-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 °C"}]
    reply = c.chat.completions.create(model=m, messages=messages, tools=[CITY],
                                      tool_choice="none", max_tokens=1)
    hf = AutoTokenizer.from_pretrained(str(model_dir))
    decoded = [*ASK, {"role": "assistant", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        messages[2]]
    want = hf.apply_chat_template(decoded, tools=[CITY], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert '"arguments": {"city": "Paris", "days": 2}' in hf.decode(want)
    assert "<tool_response>\nsunny, 21 °C\n</tool_response>" in hf.decode(want)
    assert reply.usage.prompt_tokens == len(want)
    tokenized = httpx.post(f"{served.url}/tokenize", json={
        "messages": messages, "tools": [CITY]}).json()
    assert tokenized["tokens"] == want


def test_tool_requests_the_server_cannot_serve_get_vllms_400s(served: Served) -> None:
    c, m = client(served), model_id(served)

    def error(**kwargs: Any) -> dict[str, Any]:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=m, messages=ASK, max_tokens=4, **kwargs)
        return info.value.body  # type: ignore[return-value]

    assert "`tools` must be set" in error(tool_choice="required")["message"]
    assert error(tools=[WEATHER], tool_choice={"type": "function", "function": {
        "name": "nope"}})["param"] == "tool_choice"
    assert error(tools=[WEATHER], tool_choice="sometimes")["param"] == "tool_choice"
    assert error(tools=[{"type": "function", "function": {"description": "no name"}}]
                 )["param"] == "tools"
    r = httpx.post(f"{served.url}/v1/completions", json={
        "model": m, "prompt": "hi", "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_auto_needs_the_servers_parser(served_demo: Served, tmp_path: Path) -> None:
    """Without --enable-auto-tool-choice, tools with "auto" (or no tool_choice) get vLLM's
    400; named and required are served."""
    c, m = client(served_demo), model_id(served_demo)
    for choice in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            c.chat.completions.create(model=m, messages=[{"role": "user", "content": "1+1="}],
                                      tools=[WEATHER], max_tokens=4, **choice)
    named = c.chat.completions.create(
        model=m, messages=[{"role": "user", "content": "1+1="}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40, temperature=0)
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_weather"]
