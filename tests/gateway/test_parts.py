"""Gateway pieces in isolation: config, tokenizer/chat template, detokenizer, sampling."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import jinja2
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from common.messages import SamplingParams
from gateway.api.output import StopStrings
from gateway.api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.api.sampling import ModelLimits, sampling_params
from gateway.config import parse_args
from gateway.errors import GatewayError
from gateway.generation_config import SamplingDefaults
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.tokenizer import Tokenizer
from tests.support.gateway import CHATML, write_checkpoint

LLAMA_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + eos_token }}"
    "{% endif %}{% endfor %}"
)
# Whitespace control (trim_blocks/lstrip_blocks), tojson, loop controls and {% generation %}.
BLOCKY = """{%- for m in messages %}
  {% if m.role == 'system' %}
SYS {{ m.content | tojson }}
  {% elif m.role == 'assistant' %}
A: {% generation %}{{ m.content }}{% endgeneration %}
  {% else %}
{{ m.role }}: {{ m.content }}
    {% if loop.index > 50 %}{% break %}{% endif %}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}A:{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": 'Be "brief" <tag> & naïve café'},
        {"role": "user", "content": "Grüße 你好 🚀"},
        {"role": "assistant", "content": "  Hello, world!  "},
        {"role": "user", "content": "déjà vu?"},
    ],
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "chatml": write_checkpoint(root / "chatml"),
        "llama": write_checkpoint(root / "llama", LLAMA_STYLE, add_bos=True, bos_token="<s>"),
        "blocky": write_checkpoint(root / "blocky", BLOCKY),
    }


@pytest.fixture(scope="module")
def tokenizer(checkpoints: dict[str, Path]) -> Tokenizer:
    loaded = Tokenizer.load(checkpoints["chatml"])
    assert loaded is not None
    return loaded


# --- config -------------------------------------------------------------------------------


def test_config_flags_and_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("PORT", "ENGINE", "HOST", "SERVED_MODEL_NAME", "MAX_MODEL_LEN"):
        monkeypatch.delenv(f"SWITCHYARD_{name}", raising=False)
    model = tmp_path / "Tiny-MoE"
    model.mkdir()
    config = parse_args(["--model", str(model), "--engine", "10.0.0.1:7001"])
    assert config.engines == (("10.0.0.1", 7001),)
    assert config.served_model_name == "Tiny-MoE"
    assert (config.host, config.port, config.ready_fd) == ("127.0.0.1", 8000, None)
    monkeypatch.setenv("SWITCHYARD_PORT", "0")
    monkeypatch.setenv("SWITCHYARD_ENGINE", "localhost:9")
    config = parse_args(["--model", str(model), "--served-model-name", "m",
                         "--max-model-len", "9"])
    assert (config.port, config.engines[0][1], config.served_model_name) == (0, 9, "m")
    assert config.max_model_len == 9


@pytest.mark.parametrize(("flags", "error"), [
    (["--engine", "no-port"], "--engine: expected an address of the form HOST:PORT, got "
                              "'no-port'"),
    (["--model", "/no/such/dir"], "--model: /no/such/dir is not a directory"),
    (["--generation-config", "/no/such/dir"], "--generation-config: "
                                              "/no/such/dir/generation_config.json does not "
                                              "exist")])
def test_config_rejects_bad_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  flags: list[str], error: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", str(tmp_path), "--engine", "127.0.0.1:1", *flags])
    assert exit_.value.code == 2 and f"error: {error}" in capsys.readouterr().err


# --- tokenizer and chat template ----------------------------------------------------------


@pytest.mark.parametrize("name", ["chatml", "llama", "blocky"])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(
    checkpoints: dict[str, Path], name: str, messages: list[dict[str, str]]
) -> None:
    if name == "llama" and messages[0]["role"] == "system":
        messages = messages[1:]
    ours = Tokenizer.load(checkpoints[name])
    theirs = AutoTokenizer.from_pretrained(str(checkpoints[name]))
    assert ours is not None
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.render_chat(messages) == expected
    expected_ids = theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours.encode_chat(messages) == expected_ids


# Qwen3's switch, in the shape of its template: the request's chat_template_kwargs set it.
THINKING = CHATML + ("{% if add_generation_prompt and enable_thinking is defined and "
                     "enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}")


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_chat_template_variables_as_transformers_passes_them(
        tmp_path: Path, kwargs: dict[str, object], generation_prompt: bool) -> None:
    model = write_checkpoint(tmp_path / "qwen-like", THINKING)
    ours, theirs = Tokenizer.load(model), AutoTokenizer.from_pretrained(str(model))
    assert ours is not None
    messages = CONVERSATIONS[0]
    assert ours.render_chat(messages, generation_prompt, kwargs) == theirs.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs)


TOOL_USE = CHATML + "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
NAMED_TEMPLATES = {  # where a checkpoint keeps several templates: the config, or files
    "config": lambda d: write_checkpoint(d, [{"name": "default", "template": CHATML},
                                             {"name": "tool_use", "template": TOOL_USE}]),
    "files": lambda d: (write_checkpoint(d, "{{ 'overridden by the files' }}"),
                        (d / "chat_template.jinja").write_text(CHATML),
                        (d / "additional_chat_templates").mkdir(),
                        (d / "additional_chat_templates" / "tool_use.jinja").write_text(
                            TOOL_USE))[0]}


@pytest.mark.parametrize("where", NAMED_TEMPLATES)
def test_named_templates_are_picked_as_transformers_picks_them(tmp_path: Path,
                                                               where: str) -> None:
    """"tool_use" when the request gives tools (even none), else the default (Mixtral
    8x22B and Hermes checkpoints ship both)."""
    model = NAMED_TEMPLATES[where](tmp_path / "m")
    ours, theirs = Tokenizer.load(model), AutoTokenizer.from_pretrained(str(model))
    assert ours is not None
    tool = {"type": "function", "function": {"name": "lookup"}}
    messages = CONVERSATIONS[0]
    for tools in (None, [], [tool]):
        kwargs = {} if tools is None else {"tools": tools}
        assert ours.render_chat(messages, template_kwargs=kwargs) == \
            theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                       tokenize=False)
    assert "[tool lookup]" in ours.render_chat(messages, template_kwargs={"tools": [tool]})


def test_template_errors_are_bad_requests(checkpoints: dict[str, Path]) -> None:
    ours = Tokenizer.load(checkpoints["llama"])
    assert ours is not None
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(GatewayError) as caught:
        ours.render_chat(twice)
    assert caught.value.status == 400 and "must alternate" in caught.value.message
    with pytest.raises(jinja2.TemplateError):
        AutoTokenizer.from_pretrained(str(checkpoints["llama"])).apply_chat_template(twice)


def test_tokenizer_json_bos_matches_transformers(checkpoints: dict[str, Path]) -> None:
    ours = Tokenizer.load(checkpoints["llama"])
    theirs = AutoTokenizer.from_pretrained(str(checkpoints["llama"]))
    assert ours is not None
    text = "Hello, world! 你好"
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.encode(text)[0] == ours.backend.token_to_id("<s>")


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    assert Tokenizer.load(tmp_path) is None


# --- incremental detokenizer --------------------------------------------------------------

TEXT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"), max_size=40)


@settings(max_examples=150, deadline=None)
@given(prompt=TEXT, text=TEXT, data=st.data())
def test_detokenizer_never_emits_partial_characters(
    tokenizer: Tokenizer, prompt: str, text: str, data: st.DataObject
) -> None:
    prompt_ids = tokenizer.encode(prompt)
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    pieces, start = [], 0
    while start < len(ids):
        size = data.draw(st.integers(1, 3))
        pieces.append(detokenizer.add(ids[start:start + size]))
        start += size
    assert not any("\ufffd" in piece for piece in pieces)
    assert "".join(pieces) + detokenizer.flush() == tokenizer.decode(ids)


def test_detokenizer_skips_special_tokens_and_flushes_leftovers(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    im_end = tokenizer.backend.token_to_id("<|im_end|>")
    assert detokenizer.add([*tokenizer.encode("ok"), im_end]) == "ok"
    euro = tokenizer.encode("€")
    assert len(euro) == 3  # "€" is not in the training corpus: one token per UTF-8 byte
    assert detokenizer.add(euro[:2]) == ""
    assert detokenizer.flush() == "\ufffd"  # the end of the sequence releases what is left


def test_detokenizer_keeps_special_tokens_when_asked_as_transformers_decodes(
        tokenizer: Tokenizer, checkpoints: dict[str, Path]) -> None:
    """skip_special_tokens=False (vLLM's field): the text transformers decodes."""
    hf = AutoTokenizer.from_pretrained(str(checkpoints["chatml"]))
    ids = [*tokenizer.encode("ok"), tokenizer.backend.token_to_id("<|im_end|>"),
           *tokenizer.encode(" then")]
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        text = "".join(detokenizer.add([i]) for i in ids) + detokenizer.flush()
        assert text == hf.decode(ids, skip_special_tokens=skip)
        assert ("<|im_end|>" in text) == (not skip)


def test_detokenizer_keeps_leading_space_with_prompt_context() -> None:
    # SentencePiece-style decoders drop a sequence's leading space; prompt context keeps it.
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(["The capital of France is Paris"] * 3, trainer)
    tokenizer = Tokenizer(backend, {}, {})
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("The capital is"))
    paris = tokenizer.encode(" Paris")
    assert tokenizer.decode(paris) == "Paris"
    assert detokenizer.add(paris) + detokenizer.flush() == " Paris"


# --- sampling -----------------------------------------------------------------------------

LIMITS = ModelLimits(max_model_len=100, vocab_size=50)


def test_default_max_tokens_is_16_for_text_and_the_context_for_chat() -> None:
    """vLLM's defaults: a text completion without max_tokens gets 16 tokens (OpenAI's
    legacy default), a chat completion whatever the context leaves."""
    request = CompletionRequest(prompt=[1, 2, 3], temperature=0.0, top_k=-1, stop_token_ids=[7])
    params = sampling_params(request, [1, 2, 3], LIMITS)
    assert (params.max_tokens, params.temperature, params.top_p) == (16, 0.0, 1.0)
    assert sampling_params(request, [1] * 90, LIMITS).max_tokens == 10  # what is left
    chat = ChatCompletionRequest(messages=[])
    assert sampling_params(chat, [1, 2, 3], LIMITS).max_tokens == 97
    assert (params.top_k, params.stop_token_ids) == (0, (7,))  # -1 and 0 both disable top-k
    for k, want in ((49, 49), (50, 0), (2**70, 0)):  # k >= the vocabulary filters nothing
        request = CompletionRequest(prompt=[1], top_k=k)
        params = sampling_params(request, [1], LIMITS)
        assert params.top_k == want
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) \
            == params  # fits the wire to the engine (a huge k was a 500)


def test_max_completion_tokens_wins_for_chat() -> None:
    request = ChatCompletionRequest(messages=[], max_tokens=5, max_completion_tokens=9)
    assert sampling_params(request, [1], LIMITS).max_tokens == 9


@pytest.mark.parametrize(
    ("request_fields", "prompt", "needle"),
    [
        ({"max_tokens": 98}, [1, 2, 3], "too large: 98"),
        ({}, list(range(1, 50)) * 3, "maximum context length is 100 tokens"),
        ({}, [], "empty"),
        ({}, [1, 50], "out of vocabulary"),
        ({"stop_token_ids": [99]}, [1], "stop_token_ids"),
    ],
)
def test_sampling_rejections(request_fields: dict[str, object], prompt: list[int],
                             needle: str) -> None:
    request = CompletionRequest(prompt=prompt, **request_fields)  # type: ignore[arg-type]
    with pytest.raises(GatewayError) as caught:
        sampling_params(request, prompt, LIMITS)
    assert caught.value.status == 400 and needle in caught.value.message


# Qwen3-30B-A3B's generation_config.json (the values vLLM then serves as defaults)
QWEN3_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                    "transformers_version": "4.51.0"}


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION))
    defaults = SamplingDefaults.load("auto", tmp_path)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert defaults.describe() == "temperature=0.6, top_p=0.95, top_k=20"
    left_out = sampling_params(CompletionRequest(prompt=[1]), [1], LIMITS, defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.6, 0.95, 20)
    assert (left_out.min_p, left_out.repetition_penalty) == (0.0, 1.0)  # not in the file
    given = sampling_params(CompletionRequest(prompt=[1], temperature=0, top_p=1, top_k=-1,
                                              min_p=0.1), [1], LIMITS, defaults)
    assert (given.temperature, given.top_p, given.top_k, given.min_p) == (0.0, 1.0, 0, 0.1)
    assert SamplingDefaults.load("vllm", tmp_path) == SamplingDefaults()
    assert SamplingDefaults.load("auto", tmp_path / "elsewhere") == SamplingDefaults()


def test_generation_defaults_as_transformers_diff_them(tmp_path: Path) -> None:
    """Values equal to transformers' own defaults change nothing (vLLM reads the file
    through `to_diff_dict()`); max_new_tokens caps every request; bad values are named."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 1.0, "top_k": 50, "repetition_penalty": 1.1, "max_new_tokens": 8}))
    defaults = SamplingDefaults.load(str(tmp_path), Path("/unused"))
    assert defaults == SamplingDefaults(repetition_penalty=1.1, max_tokens=8)
    capped = sampling_params(CompletionRequest(prompt=[1], max_tokens=30), [1], LIMITS, defaults)
    assert (capped.max_tokens, capped.repetition_penalty) == (8, 1.1)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": "20"}))
    with pytest.raises(ValueError, match=r"json: top_k must be an integer, got '20'"):
        SamplingDefaults.load("auto", tmp_path)
    (tmp_path / "generation_config.json").write_text("[]")
    with pytest.raises(ValueError, match="not a JSON object"):
        SamplingDefaults.load("auto", tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        SamplingDefaults.load(str(tmp_path / "nowhere"), tmp_path)


# --- stop strings ---------------------------------------------------------------------------

@given(pieces=st.lists(st.text(alphabet="abc\n", max_size=5), max_size=12),
       stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=3), min_size=1,
                      max_size=3), include=st.booleans(), protected=st.integers(0, 12))
def test_stop_strings_cut_the_stream_just_before_a_stop(pieces: list[str], stops: list[str],
                                                        include: bool, protected: int) -> None:
    """Just before the earliest stop string, or just after it with `include`
    (include_stop_str_in_output). The first `protected` pieces are min_tokens' (vLLM): a
    stop string must end after them, though it may start in them."""
    whole = "".join(pieces)
    dead = len("".join(pieces[:protected]))
    checker = StopStrings(stops, include)

    def valid(text: str) -> list[tuple[int, str]]:
        """(start, stop) of every occurrence in text that ends after the protected text."""
        return [(i, stop) for stop in stops for i in range(len(text))
                if text.startswith(stop, i) and i + len(stop) > dead]

    emitted, found, hit = [], False, None
    for k, piece in enumerate(pieces):
        text, hit = checker.feed(piece, armed=k >= protected)
        found = hit is not None
        emitted.append(text)
        if found:
            break
        # No stop string lies in what was emitted so far.
        assert not valid("".join(emitted))
    if not found:
        emitted.append(checker.flush())
    out = "".join(emitted)
    assert found == bool(valid(whole))
    if found:  # in the first pieces that hold a stop: the text before the earliest one
        ends = itertools.accumulate(len(piece) for piece in pieces)
        seen = next(whole[:e] for e in ends if valid(whole[:e]))
        start = min(i for i, _ in valid(seen))
        first = next(stop for stop in stops if (start, stop) in valid(seen))  # listed first
        assert hit == first
        assert out == seen[:start + len(first) if include else start]
    else:
        assert out == whole


def test_bundled_byte_level_tokenizer_streams_multibyte_characters_whole() -> None:
    from switchyard.demo_model import DEFAULT_MODEL

    tokenizer = Tokenizer.load(DEFAULT_MODEL)
    assert tokenizer is not None
    text = "héllo wörld 你好 🚀 = 42"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # several tokens per character: splits really happen
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.add([i]) for i in ids]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + detokenizer.flush() == text


def test_engine_gauges_are_absent_while_the_engine_does_not_answer() -> None:
    """They are read at scrape time; a scrape the engine did not answer must not repeat
    the last reading as if it were current."""
    from common.messages import EngineStats
    from gateway.observability.metrics import Metrics

    metrics = Metrics("m")
    up = metrics.render(EngineStats(3, 2, 5, 10, 0, []), []).decode()
    assert 'switchyard:num_requests_running{model_name="m"} 3.0' in up
    assert 'switchyard:kv_cache_usage_perc{model_name="m"} 0.5' in up
    metrics.ttft.labels("m").observe(1000.0)  # vLLM's buckets: long CPU runs fit them
    metrics.e2e.labels("m").observe(5000.0)
    down = metrics.render(None, []).decode()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"switchyard:{name}{{" not in down
    assert 'time_to_first_token_seconds_bucket{le="2560.0",model_name="m"} 1.0' in down
    assert 'e2e_request_latency_seconds_bucket{le="1920.0",model_name="m"} 0.0' in down
    assert 'e2e_request_latency_seconds_bucket{le="7680.0",model_name="m"} 1.0' in down


def test_a_request_span_with_a_failed_choice_has_error_status() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode, format_trace_id

    from gateway.api.serving import Choice, Run
    from gateway.observability.metrics import Metrics, RequestTimer
    from gateway.observability.request_log import RequestLog

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    for reasons, status in ((["stop", "error"], StatusCode.ERROR), (["stop"], StatusCode.UNSET)):
        timers = [RequestTimer(Metrics("m")) for _ in reasons]
        for timer, reason in zip(timers, reasons, strict=True):
            timer.finish(reason)
        run = Run("cmpl-1", 0, "m", [1], [Choice(i, None, None, t)  # type: ignore[arg-type]
                                          for i, t in enumerate(timers)],
                  span=provider.get_tracer("t").start_span("text_completion m"))
        log = RequestLog()
        run._end(log)
        span = exporter.get_finished_spans()[-1]
        assert span.status.status_code == status
        # logged for the dashboard, with its trace's id
        [record] = log.slowest(since=0, n=10)
        assert record.trace_id == format_trace_id(span.context.trace_id)
        assert (record.id, record.finish_reasons) == ("cmpl-1", tuple(reasons))


def test_latencies_are_taken_when_deltas_arrive_not_when_they_are_read() -> None:
    """A delta that waited in its request's buffer (a client reading slowly) counts from
    when it came off the engine connection, as vLLM measures in the engine."""
    from common.messages import TokenDelta
    from gateway.observability.metrics import Metrics, RequestTimer

    metrics = Metrics("m")
    timer = RequestTimer(metrics)
    start = timer._start
    timer.on_delta(TokenDelta("r", [1]), arrived=start + 0.25)
    timer.on_delta(TokenDelta("r", [2], "length"), arrived=start + 1.0)
    assert timer.ttft_s == 0.25
    e2e = metrics.e2e.labels("m")._sum.get()  # type: ignore[attr-defined]
    itl = metrics.itl.labels("m")._sum.get()  # type: ignore[attr-defined]
    assert (e2e, itl) == (1.0, 0.75)


def test_echoed_logprobs_offsets_grow_over_prompt_and_output() -> None:
    """Offsets count the tokens' texts over prompt and output, as vLLM's do: with a BOS
    whose text the echoed prompt does not show, they still only grow."""
    from types import SimpleNamespace

    from common.messages import TokenLogprobs
    from gateway.api.completions import _ChoiceText
    from gateway.api.output import Output
    from gateway.api.protocol import CompletionRequest

    class Letters:  # id 0 is a BOS "<s>", id i > 0 the letter i
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join("<s>" if i == 0 else chr(ord("a") + i) for i in ids)

    def entry(token: int) -> TokenLogprobs:
        return TokenLogprobs(-0.5, [token], [-0.5], 1)

    body = CompletionRequest(prompt=[0, 1, 2], echo=True, logprobs=0, max_tokens=2)
    shaper = _ChoiceText(SimpleNamespace(maybe_tokenizer=Letters()), body,  # type: ignore[arg-type]
                         SimpleNamespace(prompt_token_ids=[0, 1, 2]), "bc")  # type: ignore[arg-type]
    first = shaper.choice(0, Output("d", [3], None, [entry(3)], [None, entry(1), entry(2)]))
    second = shaper.choice(0, Output("e", [4], "length", [entry(4)]))
    assert first.text == "bcd" and second.text == "e"
    assert first.logprobs is not None and second.logprobs is not None
    assert first.logprobs.tokens == ["<s>", "b", "c", "d"]
    assert first.logprobs.token_logprobs == [None, -0.5, -0.5, -0.5]
    assert first.logprobs.text_offset + second.logprobs.text_offset == [0, 3, 4, 5, 6]
