"""Every request feature of the OpenAI surface, through the official `openai` client,
streaming and not, against `switchyard serve` running as real processes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import openai
import pytest
import torch

from common.auth import ClusterSecret
from common.messages import AbortRequest
from common.rpc import connect, parse_address
from switchyard.serve_process import Served
from tests.support.engines import prompts, reference_greedy
from tests.support.serving import client, model_id

pytestmark = pytest.mark.timeout(300)
ARITH = "123+456="


MTP = '{"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": null}'


@pytest.fixture(scope="module")
def secret(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cluster secret `demo`'s services share: an operator's tool must prove it."""
    return ClusterSecret.generate().write(tmp_path_factory.mktemp("secret") / "secret")


@pytest.fixture(scope="module", params=[None, MTP], ids=["plain", "speculating"])
def demo(secret: Path, request: pytest.FixtureRequest) -> Iterator[Served]:
    """The bundled model, with its tokenizer and chat template; each test twice, without
    speculation and with its MTP layer's drafts (stop strings, logprobs, seeds, bias,
    grammars and the rest keep their meaning)."""
    spec = {"SWITCHYARD_SPECULATIVE_CONFIG": request.param} if request.param else {}
    with Served([], env={"SWITCHYARD_CLUSTER_SECRET_FILE": str(secret), **spec}) as served:
        yield served


@pytest.fixture(scope="module")
def tiny(qwen3_ckpt: tuple) -> Iterator[tuple[Served, object]]:
    """The tiny transformers-built Qwen3-MoE: token-id prompts, transformers as the oracle."""
    path, model = qwen3_ckpt
    with Served(["--model", str(path)]) as served:
        yield served, model






def streamed_texts(chunks: object, chat: bool) -> dict[int, str]:
    """Choice index -> concatenated text of a stream."""
    out: dict[int, str] = {}
    for chunk in chunks:  # type: ignore[attr-defined]
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            out[choice.index] = out.get(choice.index, "") + (piece or "")
    return out


SAMPLING = dict(temperature=1.3, top_p=0.9, seed=7, max_tokens=40, presence_penalty=0.3,
                frequency_penalty=0.2,
                extra_body={"top_k": 50, "min_p": 0.05, "ignore_eos": True,
                            "repetition_penalty": 1.1})


def test_seeded_completion_reproduces_and_stream_equals_non_stream(demo: Served) -> None:
    c, m = client(demo), model_id(demo)
    first = c.completions.create(model=m, prompt=ARITH, **SAMPLING)
    again = c.completions.create(model=m, prompt=ARITH, **SAMPLING)
    assert first.choices[0].text == again.choices[0].text
    assert first.usage.completion_tokens == 40 and first.choices[0].finish_reason == "length"
    stream = c.completions.create(model=m, prompt=ARITH, stream=True, **SAMPLING)
    assert streamed_texts(stream, chat=False) == {0: first.choices[0].text}
    other = c.completions.create(model=m, prompt=ARITH, **{**SAMPLING, "seed": 8})
    assert other.choices[0].text != first.choices[0].text  # 40 tokens at temperature 1.3


def test_seeded_chat_stream_equals_non_stream(demo: Served) -> None:
    c, m = client(demo), model_id(demo)
    messages = [{"role": "user", "content": ARITH}]
    whole = c.chat.completions.create(model=m, messages=messages, **SAMPLING)
    stream = c.chat.completions.create(model=m, messages=messages, stream=True, **SAMPLING)
    assert streamed_texts(stream, chat=True) == {0: whole.choices[0].message.content}


def test_n_choices_streaming_and_not(demo: Served) -> None:
    c, m = client(demo), model_id(demo)
    messages = [{"role": "user", "content": ARITH}]
    kw = dict(model=m, messages=messages, n=3, seed=11, temperature=1.0, max_tokens=24,
              extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**kw)
    assert [ch.index for ch in whole.choices] == [0, 1, 2]
    texts = [ch.message.content for ch in whole.choices]
    assert len(set(texts)) > 1
    assert whole.usage.completion_tokens == 3 * 24
    assert all(ch.finish_reason == "length" for ch in whole.choices)
    chunks = list(c.chat.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert streamed_texts(chunks, chat=True) == dict(enumerate(texts))
    assert chunks[-1].usage.completion_tokens == 3 * 24
    finishes = {ch.index: ch.finish_reason for chunk in chunks for ch in chunk.choices
                if ch.finish_reason}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    single = c.chat.completions.create(**{**kw, "n": 1})
    assert single.choices[0].message.content == texts[0]  # choice i uses seed + i
    completions = c.completions.create(model=m, prompt=ARITH, n=2, seed=3, max_tokens=10,
                                       temperature=1.0)
    assert [ch.index for ch in completions.choices] == [0, 1]


def _greedy_text(c: openai.OpenAI, m: str) -> str:
    text = c.completions.create(model=m, prompt=ARITH, temperature=0, max_tokens=40,
                                extra_body={"ignore_eos": True}).choices[0].text
    assert len(text) >= 12, text
    return text


def test_stop_strings_cut_before_the_stop_streaming_and_not(demo: Served) -> None:
    c, m = client(demo), model_id(demo)
    text = _greedy_text(c, m)
    stop = text[6:9]
    want = text[:text.find(stop)]
    for stops in (stop, [stop, "never-there"]):
        kw = dict(model=m, prompt=ARITH, temperature=0, max_tokens=40, stop=stops,
                  extra_body={"ignore_eos": True})
        whole = c.completions.create(**kw)
        assert whole.choices[0].text == want
        assert whole.choices[0].finish_reason == "stop"
        assert whole.choices[0].stop_reason == stop  # type: ignore[attr-defined]  # vLLM's
        chunks = list(c.completions.create(**kw, stream=True))
        pieces = [ch.choices[0].text for ch in chunks if ch.choices]
        assert "".join(pieces) == want
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert chunks[-1].choices[0].stop_reason == stop  # type: ignore[attr-defined]
    messages = [{"role": "user", "content": "What is 123 + 456?"}]  # 579
    for stream in (False, True):
        r = c.chat.completions.create(model=m, messages=messages, temperature=0,
                                      max_tokens=40, stop=["never-there", "7"], stream=stream)
        last = list(r)[-1].choices[0] if stream else r.choices[0]
        assert last.finish_reason == "stop" and last.stop_reason == "7"  # type: ignore[attr-defined]
        done = c.chat.completions.create(model=m, messages=messages, temperature=0,
                                         max_tokens=40, stream=stream)
        last = list(done)[-1].choices[0] if stream else done.choices[0]
        assert last.finish_reason == "stop" and last.stop_reason is None  # type: ignore[attr-defined]  # EOS
    # A stop string that never appears changes nothing.
    none = c.completions.create(model=m, prompt=ARITH, temperature=0, max_tokens=40,
                                stop=["never-there"], extra_body={"ignore_eos": True})
    assert none.choices[0].text == text and none.choices[0].finish_reason == "length"


def test_stop_token_ids_and_ignore_eos(tiny: tuple) -> None:
    served, model = tiny
    c, m = client(served), model_id(served)
    prompt = prompts(seed=21, lengths=(6,))[0]
    want = reference_greedy(model, prompt, 16)
    stop_id = want[5]
    cut = want.index(stop_id) + 1
    r = c.completions.create(model=m, prompt=prompt, temperature=0, max_tokens=16,
                             extra_body={"stop_token_ids": [stop_id], "ignore_eos": True,
                                         "return_token_ids": True})
    assert r.choices[0].token_ids == want[:cut]  # type: ignore[attr-defined]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason == stop_id  # type: ignore[attr-defined]  # vLLM's
    full = c.completions.create(model=m, prompt=prompt, temperature=0, max_tokens=16,
                                extra_body={"ignore_eos": True, "return_token_ids": True})
    assert full.choices[0].token_ids == want  # type: ignore[attr-defined]
    assert full.choices[0].finish_reason == "length"


def test_completion_logprobs_equal_transformers(tiny: tuple) -> None:
    served, model = tiny
    c, m = client(served), model_id(served)
    prompt = prompts(seed=22, lengths=(9,))[0]
    for stream in (False, True):
        r = c.completions.create(model=m, prompt=prompt, temperature=0, max_tokens=6,
                                 logprobs=3, stream=stream,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        chunks = list(r) if stream else [r]
        tokens = [t for ch in chunks for choice in ch.choices for t in choice.token_ids or []]
        lps = [choice.logprobs for ch in chunks for choice in ch.choices if choice.logprobs]
        token_logprobs = [x for lp in lps for x in lp.token_logprobs]
        top = [x for lp in lps for x in lp.top_logprobs]
        assert len(tokens) == len(token_logprobs) == len(top) == 6  # ignore_eos: all six
        assert [s for lp in lps for s in lp.tokens] == [f"token_id:{t}" for t in tokens]
        with torch.no_grad():
            ref = model(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
        for i, token in enumerate(tokens):
            row = ref[len(prompt) - 1 + i]
            assert abs(token_logprobs[i] - float(row[token])) < 1e-4
            best = row.topk(3)
            assert list(top[i]) == [f"token_id:{t}" for t in best.indices.tolist()]
            assert max(abs(a - b) for a, b in zip(top[i].values(), best.values.tolist(),
                                                  strict=True)) < 1e-4
    # "The API will always return the logprob of the sampled token" (openai): with
    # logprobs=0, each position's top_logprobs holds that one entry (sampled, not greedy).
    r = c.completions.create(model=m, prompt=prompt, temperature=1.5, seed=5, max_tokens=6,
                             logprobs=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and len(lp.tokens or []) == 6
    assert lp.top_logprobs == [{t: x} for t, x in zip(lp.tokens or [], lp.token_logprobs or [],
                                                       strict=True)]


def test_chat_logprobs_and_max_completion_tokens(demo: Served) -> None:
    c, m = client(demo), model_id(demo)
    messages = [{"role": "user", "content": ARITH}]
    for stream in (False, True):
        r = c.chat.completions.create(model=m, messages=messages, temperature=0,
                                      max_completion_tokens=5, logprobs=True, top_logprobs=2,
                                      stream=stream, extra_body={"ignore_eos": True})
        if stream:
            entries = [e for ch in r for choice in ch.choices if choice.logprobs
                       for e in choice.logprobs.content]
        else:
            assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
            entries = r.choices[0].logprobs.content
        assert len(entries) == 5
        for e in entries:  # greedy: the chosen token is the most likely one
            assert len(e.top_logprobs) == 2
            assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
            assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)
            assert e.token == e.top_logprobs[0].token and e.logprob <= 0
    r = c.chat.completions.create(model=m, messages=messages, temperature=0, max_tokens=3,
                                  logprobs=True, top_logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True})
    named = r.choices[0].logprobs.content  # vLLM's `token_id:N` names
    assert all(e.token.startswith("token_id:") for e in named) and len(named) == 3
    assert all(t.token.startswith("token_id:") for e in named for t in e.top_logprobs)


def test_echo_prepends_the_prompt(demo: Served) -> None:
    c, m = client(demo), model_id(demo)
    whole = c.completions.create(model=m, prompt=ARITH, echo=True, temperature=0,
                                 max_tokens=8)
    plain = c.completions.create(model=m, prompt=ARITH, temperature=0, max_tokens=8)
    assert whole.choices[0].text == ARITH + plain.choices[0].text
    chunks = c.completions.create(model=m, prompt=ARITH, echo=True, temperature=0,
                                  max_tokens=8, stream=True)
    assert streamed_texts(chunks, chat=False) == {0: whole.choices[0].text}
    for ids in ([2**32], [2**64]):  # past the vocabulary: a 400, as without echo (was a 500)
        with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
            c.completions.create(model=m, prompt=ids, echo=True, max_tokens=2)


def demo_log_softmax(token_ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [L, V] over the bundled model, in float32."""
    from transformers import AutoModelForCausalLM

    from switchyard.demo_model import DEFAULT_MODEL

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].log_softmax(-1)


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(demo: Served) -> None:
    """lm-evaluation-harness's loglikelihood request (echo, logprobs=1, max_tokens=1, as
    its `local-completions` model sends it), and echo with max_tokens 0 (the prompt
    alone): the echoed prompt's tokens carry transformers' log-probabilities."""
    c, m = client(demo), model_id(demo)
    ids = c.completions.create(model=m, prompt=ARITH, max_tokens=1, echo=True,
                               extra_body={"return_token_ids": True}).choices[0]
    prompt_ids = ids.model_extra["prompt_token_ids"]  # type: ignore[index]
    n = len(prompt_ids)
    ref = demo_log_softmax(prompt_ids)
    for stream in (False, True):
        r = c.completions.create(model=m, prompt=ARITH, max_tokens=1, echo=True, logprobs=1,
                                 temperature=0, stream=stream)
        chunks = list(r) if stream else [r]
        text = "".join(choice.text for ch in chunks for choice in ch.choices)
        lps = [choice.logprobs for ch in chunks for choice in ch.choices if choice.logprobs]
        tokens = [t for lp in lps for t in lp.tokens]
        token_lps = [x for lp in lps for x in lp.token_logprobs]
        tops = [x for lp in lps for x in lp.top_logprobs]
        offsets = [x for lp in lps for x in lp.text_offset]
        assert len(tokens) == len(token_lps) == len(tops) == n + 1
        assert text.startswith(ARITH) and "".join(tokens[:n]) == ARITH
        assert token_lps[0] is None and tops[0] is None
        for j in range(1, n):
            want = float(ref[j - 1, prompt_ids[j]])
            assert abs(token_lps[j] - want) < 1e-4, (j, token_lps[j], want)
            best = int(ref[j - 1].argmax())
            assert tops[j][tokens[j]] == pytest.approx(token_lps[j])
            assert len(tops[j]) == (1 if prompt_ids[j] == best else 2)  # its own + the top 1
        assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[n] == len(ARITH)
        # what an evaluator checks: the greedy answer's first token was the likeliest
        assert max(tops[n].values()) == pytest.approx(token_lps[n])
    only = c.completions.create(model=m, prompt=ARITH, max_tokens=0, echo=True, logprobs=2)
    choice = only.choices[0]
    assert choice.text == ARITH and choice.finish_reason == "length"
    assert only.usage.completion_tokens == 0 and only.usage.prompt_tokens == n
    assert choice.logprobs is not None and len(choice.logprobs.tokens or []) == n
    assert choice.logprobs.token_logprobs[1] == pytest.approx(float(ref[0, prompt_ids[1]]),
                                                              abs=1e-4)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model=m, prompt=ARITH, max_tokens=0)


def test_prompt_logprobs_as_vllm_returns_them(tiny: tuple, demo: Served) -> None:
    """vLLM's `prompt_logprobs`: per prompt token {id: {logprob, rank, decoded_token}} for
    the token itself and the k likeliest, on completions and chat; not with streaming."""
    served, model = tiny
    c, m = client(served), model_id(served)
    prompt = prompts(seed=23, lengths=(11,))[0]
    r = c.completions.create(model=m, prompt=prompt, max_tokens=2,
                             extra_body={"prompt_logprobs": 3})
    entries = r.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)  # [L, V]
    assert len(entries) == len(prompt) and entries[0] is None
    for j, entry in enumerate(entries[1:], start=1):
        row, own = ref[j - 1], entry[str(prompt[j])]
        assert abs(own["logprob"] - float(row[prompt[j]])) < 1e-4
        assert own["rank"] == int((row > row[prompt[j]]).sum()) + 1
        assert own["decoded_token"] == f"token_id:{prompt[j]}"  # no tokenizer: vLLM's form
        best = row.topk(3).indices.tolist()
        assert [entry[str(t)]["rank"] for t in best] == [1, 2, 3]
        assert set(entry) == {str(prompt[j]), *map(str, best)}
    d, dm = client(demo), model_id(demo)
    messages = [{"role": "user", "content": ARITH}]
    chat = d.chat.completions.create(model=dm, messages=messages, max_tokens=1,
                                     extra_body={"prompt_logprobs": 0})
    scores = chat.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(scores) == chat.usage.prompt_tokens and scores[0] is None
    assert all(len(entry) == 1 for entry in scores[1:])  # the prompt's own token alone
    with pytest.raises(openai.BadRequestError, match="not available when `stream=True`"):
        d.chat.completions.create(model=dm, messages=messages, stream=True,
                                  extra_body={"prompt_logprobs": 1})


def test_logit_bias_and_allowed_token_ids(demo: Served) -> None:
    c, m = client(demo), model_id(demo)
    messages = [{"role": "user", "content": "What is 123 + 456?"}]
    plain = c.chat.completions.create(model=m, messages=messages, temperature=0, max_tokens=8)
    assert plain.choices[0].message.content == "579"
    five = httpx.post(f"{demo.url}/tokenize", json={"prompt": "5"}).json()["tokens"][-1]
    banned = c.chat.completions.create(model=m, messages=messages, temperature=0,
                                       max_tokens=8, logit_bias={str(five): -100})
    assert not (banned.choices[0].message.content or "").startswith("5")
    seven = httpx.post(f"{demo.url}/tokenize", json={"prompt": "7"}).json()["tokens"][-1]
    only = c.completions.create(model=m, prompt=ARITH, max_tokens=3, seed=1,
                                extra_body={"allowed_token_ids": [seven], "ignore_eos": True})
    assert only.choices[0].text == "777"


def test_structured_outputs_as_openai_and_vllm_take_them(demo: Served) -> None:
    """OpenAI's response_format (json_schema, json_object), vLLM's structured_outputs and
    its older guided_* fields; streamed as not; a bad schema is the request's 400."""
    c, m = client(demo), model_id(demo)
    messages = [{"role": "user", "content": "What is 123 + 456?"}]
    schema = {"type": "object", "properties": {"sum": {"type": "string", "maxLength": 3}},
              "required": ["sum"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}}
    whole = c.chat.completions.create(model=m, messages=messages, temperature=0,
                                      max_tokens=30, response_format=fmt)  # type: ignore[arg-type]
    text = whole.choices[0].message.content or ""
    assert set(json.loads(text)) == {"sum"} and whole.choices[0].finish_reason == "stop"
    stream = c.chat.completions.create(model=m, messages=messages, temperature=0,
                                       max_tokens=30, response_format=fmt, stream=True)  # type: ignore[arg-type]
    assert streamed_texts(stream, chat=True) == {0: text}
    obj = c.chat.completions.create(model=m, messages=messages, temperature=0, max_tokens=3,
                                    response_format={"type": "json_object"})
    assert (obj.choices[0].message.content or "").startswith("{")
    for extra in ({"structured_outputs": {"choice": ["579", "no"]}},
                  {"guided_choice": ["579", "no"]}):
        r = c.completions.create(model=m, prompt=ARITH, temperature=1.5, seed=3,
                                 max_tokens=5, n=3, extra_body=extra)
        assert {choice.text for choice in r.choices} <= {"579", "no"}
    with pytest.raises(openai.BadRequestError, match="structured outputs") as info:
        c.chat.completions.create(model=m, messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert info.value.body["param"] == "response_format"  # type: ignore[index]


def test_unknown_fields_are_ignored(demo: Served) -> None:
    c, m = client(demo), model_id(demo)
    r = c.completions.create(model=m, prompt=ARITH, max_tokens=4, temperature=0,
                             extra_body={"best_of_everything": 3, "user": "u-1"})
    assert r.choices[0].text == c.completions.create(model=m, prompt=ARITH, max_tokens=4,
                                                     temperature=0).choices[0].text


def test_errors_have_vllm_status_and_param(demo: Served) -> None:
    c, m = client(demo), model_id(demo)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="no-such-model", prompt=ARITH)
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model=m, prompt=ARITH, temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as long:
        c.completions.create(model=m, prompt="1+1=" * 40, max_tokens=4)
    assert "maximum context length is 128 tokens" in long.value.message
    with pytest.raises(openai.BadRequestError) as room:
        c.completions.create(model=m, prompt=ARITH, max_tokens=1000)
    assert room.value.param == "max_tokens"
    huge = b'{"prompt": "' + b"1" * (17 << 20) + b'"}'
    r = httpx.post(f"{demo.url}/v1/completions", content=huge, timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_an_engine_side_abort_ends_the_stream_with_finish_reason_abort(demo: Served,
                                                                      secret: Path) -> None:
    c, m = client(demo), model_id(demo)
    address = httpx.get(f"{demo.url}/health").json()["attention"][0]["address"]
    stream = c.completions.create(model=m, prompt=ARITH, max_tokens=100, temperature=1.0,
                                  stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))

    async def abort() -> None:
        frames = await connect(*parse_address(address), timeout=10,
                               secret=ClusterSecret.load(secret))
        await frames.send(AbortRequest(first.id))  # an operator's abort, by request id
        await frames.aclose()

    anyio.run(abort)
    finishes = [ch.choices[0].finish_reason for ch in stream if ch.choices]
    assert finishes[-1] == "abort"


def test_metrics_expose_the_operator_series(demo: Served) -> None:
    c, m = client(demo), model_id(demo)
    c.completions.create(model=m, prompt=ARITH, max_tokens=3, temperature=0)
    text = httpx.get(f"{demo.url}/metrics").text
    label = f'model_name="{m}"'
    for series in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "prompt_tokens_total", "generation_tokens_total",
                   "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                   "request_prefill_time_seconds_bucket", "request_decode_time_seconds_bucket"):
        lines = [ln for ln in text.splitlines() if ln.startswith(f"switchyard:{series}")]
        assert lines and all(label in ln for ln in lines), series
    count = next(ln for ln in text.splitlines()
                 if ln.startswith("switchyard:e2e_request_latency_seconds_count"))
    assert float(count.split()[-1]) >= 1
    assert json.loads(httpx.get(f"{demo.url}/stats").text)["num_running"] == 0


def test_a_batch_of_prompts_as_openai_and_vllm_number_it(tiny: tuple, demo: Served) -> None:
    """prompt as a list of token-id lists (or of strings): choice i * n + j is prompt i's
    choice j, each what transformers generates for its prompt; usage sums the batch."""
    served, model = tiny
    c, m = client(served), model_id(served)
    batch = prompts(seed=23, lengths=(5, 9, 3))
    want = [reference_greedy(model, p, 6) for p in batch]
    for stream in (False, True):
        r = c.completions.create(model=m, prompt=batch, n=2, temperature=0, max_tokens=6,
                                 stream=stream, stream_options={"include_usage": True}
                                 if stream else None,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        chunks = list(r) if stream else [r]
        got: dict[int, list[int]] = {}
        prompt_ids: dict[int, list[int]] = {}
        for ch in chunks:
            for choice in ch.choices:
                got.setdefault(choice.index, []).extend(getattr(choice, "token_ids", None) or [])
                if ids := getattr(choice, "prompt_token_ids", None):  # first chunk, or whole
                    prompt_ids[choice.index] = ids
        assert got == {i * 2 + j: want[i] for i in range(3) for j in range(2)}
        assert prompt_ids == {i * 2 + j: batch[i] for i in range(3) for j in range(2)}
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens == 5 + 9 + 3
        assert usage.completion_tokens == 6 * 6
    d, dm = client(demo), model_id(demo)
    texts = d.completions.create(model=dm, prompt=[ARITH, "1+1="], temperature=0,
                                 max_tokens=4, echo=True)
    alone = [d.completions.create(model=dm, prompt=p, temperature=0, max_tokens=4,
                                  echo=True).choices[0].text for p in (ARITH, "1+1=")]
    assert [ch.text for ch in texts.choices] == alone
    with pytest.raises(openai.BadRequestError, match="not a mix"):
        c.completions.create(model=m, prompt=[[1, 2], "x"], max_tokens=2)  # type: ignore[arg-type]


def test_the_models_generation_config_as_vllm_reads_it(qwen3_ckpt: tuple, tmp_path: object
                                                       ) -> None:
    """generation_config.json's end-of-sequence ids stop generation (Qwen3 adds
    <|endoftext|> there), and its sampling values are the defaults of what a request
    leaves out (vLLM's `--generation-config auto`): here greedy, at most 6 tokens."""
    import shutil
    from pathlib import Path

    path, model = qwen3_ckpt
    prompt = next(p for p in prompts(seed=31, lengths=(5, 6, 7, 8))
                  if (want := reference_greedy(model, p, 6))[2] not in want[:2])
    want = reference_greedy(model, prompt, 6)
    copy = Path(str(tmp_path)) / "with-generation-config"
    shutil.copytree(path, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({
        **config, "eos_token_id": [config["eos_token_id"], want[2]], "temperature": 0.0,
        "max_new_tokens": 6}))
    with Served(["--model", str(copy), "--dispatch-backend", "local"]) as served:
        c, m = client(served), model_id(served)
        r = c.completions.create(model=m, prompt=prompt,
                                 extra_body={"return_token_ids": True})
        assert r.choices[0].token_ids == want[:3]  # type: ignore[attr-defined]
        assert r.choices[0].finish_reason == "stop"
        r = c.completions.create(model=m, prompt=prompt, max_tokens=16,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        assert r.choices[0].token_ids == want  # type: ignore[attr-defined]
        assert r.choices[0].finish_reason == "length"


def test_prefix_cached_prompts_report_cached_tokens_as_vllm(qwen3_ckpt: tuple) -> None:
    """With --enable-prompt-tokens-details, a prompt that repeats another's first blocks
    reports them in usage.prompt_tokens_details.cached_tokens (absent while none were
    cached, as vLLM), generates what transformers does, and counts in /metrics; a cache
    salt keeps it apart; chat on the bundled model the same."""
    path, model = qwen3_ckpt
    system = prompts(seed=24, lengths=(40,))[0]
    with Served(["--model", str(path), "--enable-prompt-tokens-details"]) as served:
        c, m = client(served), model_id(served)
        args = dict(model=m, temperature=0, max_tokens=6,
                    extra_body={"ignore_eos": True, "return_token_ids": True})
        first = c.completions.create(prompt=[*system, 1, 2], **args)
        assert first.usage.prompt_tokens_details is None
        prompt = [*system, 3, 4, 5]
        again = c.completions.create(prompt=prompt, **args)
        assert again.usage.prompt_tokens_details.cached_tokens == 32  # two 16-token blocks
        assert again.choices[0].token_ids == reference_greedy(model, prompt, 6)  # type: ignore[attr-defined]
        stream = list(c.completions.create(prompt=prompt, stream=True,
                                           stream_options={"include_usage": True}, **args))
        assert stream[-1].usage.prompt_tokens_details.cached_tokens == 32
        salted = c.completions.create(prompt=prompt, **{
            **args, "extra_body": {**args["extra_body"], "cache_salt": "tenant-b"}})
        assert salted.usage.prompt_tokens_details is None
        assert salted.choices[0].token_ids == again.choices[0].token_ids  # type: ignore[attr-defined]
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            c.completions.create(prompt=prompt, **{**args, "extra_body": {"cache_salt": ""}})
        metrics = {ln.split("{")[0]: float(ln.split()[-1])
                   for ln in httpx.get(f"{served.url}/metrics").text.splitlines()
                   if ln.startswith("switchyard:prefix_cache_")}
        assert metrics["switchyard:prefix_cache_queries_total"] == 42 + 3 * 43
        assert metrics["switchyard:prefix_cache_hits_total"] == 2 * 32
    with Served(["--enable-prompt-tokens-details"]) as served:
        c, m = client(served), model_id(served)
        messages = [{"role": "system", "content": "Answer with the number alone, please."},
                    {"role": "user", "content": "What is 123 + 456?"}]
        count = httpx.post(f"{served.url}/tokenize",
                           json={"model": m, "messages": messages}).json()["count"]
        replies = [c.chat.completions.create(model=m, messages=messages, temperature=0,
                                             max_tokens=8) for _ in range(2)]
        assert replies[0].usage.prompt_tokens_details is None
        assert replies[1].usage.prompt_tokens_details.cached_tokens == (count - 1) // 16 * 16
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
