"""Speculative decoding's parts: n-gram drafts, and verification by rejection sampling
(the emitted tokens follow the target distribution, checked by a chi-square test)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from services.attention.spec_decode.ngram import propose
from services.attention.spec_decode.rejection import verify

# chi-square's 99.9% quantile with 4 degrees of freedom (a vocabulary of 5)
CHI2_4_999 = 18.467
DRAWS = 20_000


@pytest.mark.parametrize(("tokens", "k", "want"), [
    ([1, 2, 3, 9, 1, 2, 3], 2, [9, 1]),  # "1 2 3" recurs: what followed it
    ([1, 2, 3, 9, 1, 2, 3], 5, [9, 1, 2, 3]),  # up to the end of the sequence
    ([5, 1, 2, 7, 7, 1, 2, 8, 1, 2], 2, [8, 1]),  # the latest earlier occurrence
    ([4, 5, 6, 7], 3, []),  # nothing recurs
    ([1, 2, 1], 3, [2, 1]),  # the 1-gram "1"
])
def test_prompt_lookup(tokens: list[int], k: int, want: list[int]) -> None:
    assert propose(tokens, k, min_n=1, max_n=3) == want


def test_prompt_lookup_prefers_the_longest_match() -> None:
    """"3" alone last recurs before 8, but "2 3" only before 9: the longer match wins;
    with min_n above the recurring length, nothing is proposed."""
    tokens = [2, 3, 9, 0, 3, 8, 2, 3]
    assert propose(tokens, 1, min_n=1, max_n=2) == [9]
    assert propose(tokens, 1, min_n=1, max_n=1) == [8]
    assert propose(tokens, 1, min_n=3, max_n=4) == []


def test_greedy_accepts_exactly_the_argmax() -> None:
    target = torch.eye(5)[[2, 4, 1, 0]]  # [k + 1 = 4, V]: argmax 2, 4, 1, then 0
    assert verify(target, [2, 4, 1], None, greedy=True) == [2, 4, 1, 0]  # bonus 0
    assert verify(target, [2, 3, 1], None, greedy=True) == [2, 4]  # recovered at 2nd
    assert verify(target, [0, 4, 1], None, greedy=True) == [2]


# the target's distribution at positions 0, 1, 2 (mod 3) of a vocabulary of 5; it does
# not depend on earlier tokens, so every emitted token must follow its position's row
TARGET = torch.tensor([[0.50, 0.25, 0.15, 0.07, 0.03],
                       [0.05, 0.05, 0.10, 0.30, 0.50],
                       [0.20, 0.20, 0.20, 0.20, 0.20]])


def _drafter(kind: str) -> torch.Tensor | None:
    """The drafter's distribution at positions 0, 1, 2 (mod 3), [3, 5]; None: certain
    drafts of each position's least likely target token (as n-gram lookup proposes)."""
    if kind == "uniform":
        return torch.full((3, 5), 0.2)
    if kind == "adversarial":  # its mass where the target's is least
        weights = TARGET.reciprocal().pow(4)
        return weights / weights.sum(-1, keepdim=True)
    if kind == "exact":
        return TARGET.clone()
    return None


def _emitted(kind: str, k: int, draws: int, seed: int = 0,
             check: object = verify) -> torch.Tensor:
    """Counts [3, 5] of the tokens a speculating sequence emits at each position class,
    drafting `k` tokens a step from `_drafter(kind)`, until every class has `draws`."""
    g = torch.Generator().manual_seed(seed)
    q = _drafter(kind)
    counts = torch.zeros(3, 5)
    pos = 0
    while counts.sum(-1).min() < draws:
        rows = [(pos + i) % 3 for i in range(k + 1)]
        if q is None:
            drafts = [int(TARGET[r].argmin()) for r in rows[:k]]
            draft_probs = None
        else:
            draft_probs = q[rows[:k]]  # [k, V]
            drafts = [int(torch.multinomial(p, 1, generator=g)) for p in draft_probs]
        out = check(TARGET[rows], drafts, draft_probs, False, g)  # type: ignore[operator]
        for i, token in enumerate(out):
            counts[(pos + i) % 3, token] += 1
        pos += len(out)
    return counts


def _chi2(counts: torch.Tensor) -> list[float]:
    """Pearson's statistic of each position class's counts [5] against TARGET's row."""
    expected = TARGET * counts.sum(-1, keepdim=True)
    return ((counts - expected) ** 2 / expected).sum(-1).tolist()


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("kind", ["uniform", "adversarial", "exact", "one-hot"])
def test_emitted_tokens_follow_the_target_distribution(kind: str, k: int) -> None:
    """20,000 tokens at each of 3 positions (mod 3), drafts from the drafter's own
    distribution, an adversarial one, the target itself, or certain least-likely tokens:
    each position's tokens pass a chi-square test against its target row (99.9%)."""
    assert max(_chi2(_emitted(kind, k, DRAWS))) < CHI2_4_999


def test_a_broken_recovery_is_caught() -> None:
    """The same test's power: recovering from the target p instead of norm(max(p - q, 0))
    skews the emitted tokens (toward the drafts' rejected tokens) and fails it."""
    def broken(target: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
               greedy: bool, g: torch.Generator) -> list[int]:
        out = verify(target, drafts, q, greedy, g)
        accepted = len(out) - 1
        if accepted < len(drafts):  # rejected: draw from p instead
            out[-1] = int(torch.multinomial(target[accepted], 1, generator=g))
        return out

    assert max(_chi2(_emitted("adversarial", 1, DRAWS, check=broken))) > CHI2_4_999
    assert max(_chi2(_emitted("one-hot", 1, DRAWS, check=broken))) > CHI2_4_999


def test_a_seeded_verification_draws_the_same_tokens() -> None:
    q = _drafter("uniform")
    drafts = [4, 0, 2]
    runs = [[verify(TARGET[[0, 1, 2, 0]], drafts, q[[0, 1, 2]], False,
                    torch.Generator().manual_seed(7)) for _ in range(3)] for _ in range(2)]
    assert runs[0] == runs[1]


def _spec_engine(path: object, spec: str | None, graph_capture: object = None,
                 **kw: object) -> object:
    from services.attention.builder import build_engine
    from services.attention.config import AttentionConfig
    from services.attention.spec_decode.config import parse_speculative_config

    settings = {"kv_cache_memory": 1 << 24, "max_num_batched_tokens": 64, **kw}
    return build_engine(AttentionConfig(model=path, speculative=parse_speculative_config(spec),
                                        **settings),  # type: ignore[arg-type]
                        graph_capture)  # type: ignore[arg-type]


def _drafted() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("switchyard:spec_decode_num_draft_tokens_total") or 0.0


def _accepted() -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("switchyard:spec_decode_num_accepted_tokens_total") or 0.0


# prompts whose continuations repeat what came before, and one that does not
SPEC_PROMPTS = ([5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3, 1, 2, 3, 1, 2],
                [40, 41, 17, 99, 3, 250, 12])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_ngram_speculation_keeps_the_greedy_tokens(qwen3_ckpt: tuple, k: int) -> None:
    """Greedy requests with n-gram drafts of up to k tokens: every request's tokens are
    those without speculation, and drafts were accepted (it did speculate)."""
    from tests.support.engines import greedy, run_to_completion

    path = qwen3_ckpt[0]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": k})
    outputs, accepted = {}, 0.0
    for setting in (None, spec):
        engine = _spec_engine(path, setting)
        before = _accepted()
        try:
            outputs[setting] = run_to_completion(engine, {  # type: ignore[arg-type]
                0: [greedy("a", list(SPEC_PROMPTS[0]), 40), greedy("b", list(SPEC_PROMPTS[1]), 33)],
                3: [greedy("c", list(SPEC_PROMPTS[2]), 25)]})
        finally:
            engine.close()  # type: ignore[attr-defined]
        accepted = _accepted() - before
    assert outputs[spec] == outputs[None]
    assert accepted > 0


@pytest.mark.parametrize(("method", "checkpoint"), [("ngram", "qwen3_ckpt"),
                                                  ("mtp", "deepseek_v3_mtp_ckpt")])
def test_speculation_with_preemption_and_prefix_caching(
        method: str, checkpoint: str, request: pytest.FixtureRequest) -> None:
    """A KV budget that preempts: drafts of a preempted sequence are taken back, its
    recomputation finds its cached prefix (MTP: its MTP layer's KV in the same blocks),
    and the tokens stay those without drafts."""
    from services.attention.kv_cache import kv_bytes_per_block
    from services.model.config import ModelConfig
    from tests.support.engines import greedy, run_to_completion

    path = request.getfixturevalue(checkpoint)[0]
    spec = json.dumps({"method": method, "num_speculative_tokens": 3})
    outputs, preemptions = {}, {}
    # 24 blocks of 4 tokens: the three sequences need about 45 at their longest
    cfg = ModelConfig.from_dir(path)
    budget = 24 * kv_bytes_per_block(cfg, 4, torch.float32, cfg.num_layers + cfg.mtp_layers)
    for setting in (None, spec):
        engine = _spec_engine(path, setting, kv_cache_memory=budget, block_size=4,
                              max_num_batched_tokens=32)
        try:
            outputs[setting] = run_to_completion(engine, {  # type: ignore[arg-type]
                0: [greedy(f"r{i}", list(p) * 2, 40) for i, p in enumerate(SPEC_PROMPTS)]})
            preemptions[setting] = engine.scheduler.num_preemptions  # type: ignore[attr-defined]
        finally:
            engine.close()  # type: ignore[attr-defined]
    assert preemptions[spec] > 0
    assert outputs[spec] == outputs[None]


def test_no_drafts_above_the_batch_size_threshold() -> None:
    """`disable_by_batch_size` (8 for n-gram, 4 for MTP unless given; null: never): a step
    with more running sequences than that drafts for none of them."""
    from common.messages import SamplingParams
    from services.attention.sequence import Sequence
    from services.attention.spec_decode.config import parse_speculative_config
    from services.attention.spec_decode.speculator import Speculator

    def running(n: int) -> list[Sequence]:
        seqs = [Sequence(f"s{i}", [1, 2, 3, 1, 2], 4, SamplingParams(max_tokens=9))
                for i in range(n)]
        for seq in seqs:
            seq.num_computed_tokens = 4  # decoding
        return seqs

    default = Speculator(parse_speculative_config(  # type: ignore[arg-type]
        '{"method": "ngram", "num_speculative_tokens": 2}'), 100)
    assert len(default.draft(running(8))) == 8
    assert default.draft(running(9)) == {}
    never = Speculator(parse_speculative_config(  # type: ignore[arg-type]
        '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": null}'),
        100)
    assert len(never.draft(running(9))) == 9
    mtp = parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 1}')
    assert mtp is not None and mtp.disable_by_batch_size == 4


@pytest.mark.parametrize(("text", "error"), [
    ('{"method": "eagle", "num_speculative_tokens": 1}',
     "method must be one of ['mtp', 'ngram']"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 9}', "at most 8"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4}',
     "prompt_lookup_max must be at least prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown field 'k'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}',
     "disable_by_batch_size must be"),
    ("[1]", "must be a JSON object"), ("{", "is not JSON"),
])
def test_a_bad_speculative_config_names_its_field(text: str, error: str) -> None:
    from services.attention.spec_decode.config import parse_speculative_config

    with pytest.raises(ValueError, match=re.escape(error)):
        parse_speculative_config(text)


def test_the_engines_sampling_distribution_is_preserved() -> None:
    """Through `Speculator.accept` (the engine's own sampling distribution: temperature 0.7
    and top-p 0.9 over the logits, and a seeded request's generator): with 2 certain
    drafts a step, each the position's least likely token, 20,000 tokens at each of 3
    positions follow that distribution (chi-square, 99.9%)."""
    from common.messages import SamplingParams
    from services.attention.sampler import sampling_probs
    from services.attention.sequence import Sequence
    from services.attention.spec_decode.speculator import Speculator

    logits = TARGET.log() * 1.3  # [3, V]
    params = SamplingParams(max_tokens=10**6, temperature=0.7, top_p=0.9, seed=11)
    want = sampling_probs(logits, [params] * 3)  # [3, V]; top-p drops some tokens
    assert (want == 0).any()
    seq = Sequence("s", [0], 1, params)
    counts = torch.zeros(3, 5)
    while counts.sum(-1).min() < DRAWS:
        pos = seq.num_output_tokens
        rows = [(pos + i) % 3 for i in range(3)]
        drafts = [int(TARGET[r].argmin()) for r in rows[:2]]
        seq.token_ids.extend(drafts)
        emitted, _ = Speculator.accept(seq, 2, logits[rows])
        for i, token in enumerate(emitted):
            counts[(pos + i) % 3, token] += 1
        seq.token_ids.extend(emitted)
    expected = want * counts.sum(-1, keepdim=True)
    assert counts[expected == 0].sum() == 0  # nothing top-p dropped is ever emitted
    kept = expected > 0
    stats = [((counts[r] - expected[r]) ** 2 / expected[r].clamp_min(1e-9))[kept[r]].sum()
             for r in range(3)]
    # chi-square's 99.9% quantile for the kept tokens' degrees of freedom (at most 4)
    assert all(float(s) < CHI2_4_999 for s in stats), stats


def test_a_seeded_sampled_request_speculates_the_same_tokens_every_run(
        qwen3_ckpt: tuple) -> None:
    """Temperature 1 with a seed, n-gram drafts on: two runs give the same tokens, and
    each emitted token's logprob entry is there."""
    from common.messages import GenerateRequest, SamplingParams
    from tests.support.engines import run_to_completion

    path = qwen3_ckpt[0]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    runs = []
    for _ in range(2):
        engine = _spec_engine(path, spec)
        deltas: list = []
        try:
            runs.append(run_to_completion(engine, {0: [GenerateRequest(  # type: ignore[arg-type]
                "s", list(SPEC_PROMPTS[1]) * 3, SamplingParams(
                    max_tokens=40, temperature=1.0, seed=3, logprobs=2, ignore_eos=True))]},
                deltas.append))
        finally:
            engine.close()  # type: ignore[attr-defined]
        assert all(len(d.logprobs or []) == len(d.token_ids) for d in deltas)
    assert runs[0] == runs[1] and len(runs[0]["s"]) == 40


def test_every_family_keeps_its_greedy_tokens_with_speculation(every_ckpt: tuple) -> None:
    """Qwen3-MoE, Mixtral, Qwen2-MoE and the DeepSeek family (MLA's latent rows, dense
    first layers, group routing): greedy tokens with n-gram drafts of up to 3 are those
    without, and those are transformers'."""
    from tests.support.engines import greedy, reference_greedy, run_to_completion

    path, model = every_ckpt
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    outputs = {}
    for setting in (None, spec):
        engine = _spec_engine(path, setting)
        try:
            outputs[setting] = run_to_completion(engine, {  # type: ignore[arg-type]
                0: [greedy(f"r{i}", list(p), 20) for i, p in enumerate(SPEC_PROMPTS)]})
        finally:
            engine.close()  # type: ignore[attr-defined]
    assert outputs[spec] == outputs[None]
    assert outputs[None] == {f"r{i}": reference_greedy(model, list(p), 20)
                             for i, p in enumerate(SPEC_PROMPTS)}


def _mtp(k: int) -> str:
    return json.dumps({"method": "mtp", "num_speculative_tokens": k,
                       "disable_by_batch_size": None})


def test_mtp_drafts_are_the_mtp_layers_greedy_tokens(deepseek_v3_mtp_ckpt: tuple) -> None:
    """After every step, a speculating sequence's MTP draft is the argmax of the MTP
    layer's logits as transformers' blocks compute them over the whole sequence so far
    (`train_demo.forward`): the MTP's KV is right at every position, the prompt's and
    the verified tokens'."""
    from common.messages import GenerateRequest, SamplingParams
    from training.train_demo import forward

    path, model, mtp = deepseek_v3_mtp_ckpt
    engine = _spec_engine(path, _mtp(1), max_num_batched_tokens=8)  # the prompt in chunks
    prompt = [40, 41, 17, 99, 3, 250, 12, 7, 7, 30, 31]
    checked = 0
    try:
        engine.add(GenerateRequest("r", prompt, SamplingParams(  # type: ignore[attr-defined]
            max_tokens=20, temperature=0.0, ignore_eos=True)))
        while engine.has_work():  # type: ignore[attr-defined]
            engine.step()  # type: ignore[attr-defined]
            seq = engine._seqs.get("r")  # type: ignore[attr-defined]
            if seq is None or not seq.drafts:
                continue
            ids = torch.tensor([seq.token_ids])
            with torch.no_grad():
                want = forward(model, mtp, ids, ids, 0.0).mtp_logits[0, -2].argmax()
            assert seq.drafts == [int(want)]
            checked += 1
    finally:
        engine.close()  # type: ignore[attr-defined]
    assert checked >= 10


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_speculation_keeps_the_greedy_tokens(deepseek_v3_mtp_ckpt: tuple, k: int) -> None:
    """Greedy requests with MTP drafts of up to k tokens over a random DeepSeek-V3 and its
    MTP layer: transformers' tokens, with drafts verified (a random MTP layer's are
    rejected nearly always: the rejections' KV is rolled back)."""
    from tests.support.engines import greedy, reference_greedy, run_to_completion

    path, model, _ = deepseek_v3_mtp_ckpt
    engine = _spec_engine(path, _mtp(k))
    before = _drafted()
    try:
        got = run_to_completion(engine, {  # type: ignore[arg-type]
            0: [greedy("a", list(SPEC_PROMPTS[0]), 24), greedy("b", list(SPEC_PROMPTS[1]), 17)],
            3: [greedy("c", list(SPEC_PROMPTS[2]), 21)]})
    finally:
        engine.close()  # type: ignore[attr-defined]
    assert got == {"a": reference_greedy(model, list(SPEC_PROMPTS[0]), 24),
                   "b": reference_greedy(model, list(SPEC_PROMPTS[1]), 17),
                   "c": reference_greedy(model, list(SPEC_PROMPTS[2]), 21)}
    assert _drafted() > before


def _demo_requests(n: int) -> list[object]:
    """The bundled model's own questions, greedy."""
    from common.messages import GenerateRequest, SamplingParams
    from switchyard.demo_task import problems
    from training.train_demo import Encoder

    enc = Encoder()
    return [GenerateRequest(f"q{i}", enc.prompt(p.question),
                            SamplingParams(max_tokens=16, temperature=0.0))
            for i, p in enumerate(problems(11, n))]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_bundled_models_mtp_keeps_its_answers(k: int) -> None:
    """The bundled model's MTP layer drafts its arithmetic answers: every answer as
    without speculation, at most k drafts a step, and most first drafts accepted."""
    from prometheus_client import REGISTRY

    from switchyard.demo_model import DEFAULT_MODEL
    from tests.support.engines import run_to_completion

    def first_accepted() -> float:
        return REGISTRY.get_sample_value("switchyard:spec_decode_num_accepted_tokens_per_pos_total",
                                         {"position": "0"}) or 0.0

    def drafts() -> float:
        return REGISTRY.get_sample_value("switchyard:spec_decode_num_drafts_total") or 0.0

    outputs, counts = {}, {}
    for spec in (None, _mtp(k)):
        engine = _spec_engine(DEFAULT_MODEL, spec)
        before = (first_accepted(), drafts())
        try:  # a few at a time, arriving in turn
            outputs[spec] = run_to_completion(engine, {  # type: ignore[arg-type]
                i: [r] for i, r in enumerate(_demo_requests(12))})
        finally:
            engine.close()  # type: ignore[attr-defined]
        counts[spec] = (first_accepted() - before[0], drafts() - before[1])
    assert outputs[_mtp(k)] == outputs[None]
    accepted, drafted = counts[_mtp(k)]
    assert drafted >= 12 and accepted / drafted > 0.7


def test_verify_steps_replay_the_decode_graphs(deepseek_v3_mtp_ckpt: tuple) -> None:
    """The CUDA-graph path (re-run eagerly on a CPU): a verify step's rows are decode
    rows, each over its own keys, so a step of 1 + k rows a sequence replays the decode
    graphs as any decode step; the MTP passes run eagerly. Greedy tokens are
    transformers', and graphs of 3 and more rows ran (verify steps)."""
    from services.attention.graphs import eager_capture
    from tests.support.engines import greedy, reference_greedy, run_to_completion

    path, model, _ = deepseek_v3_mtp_ckpt
    engine = _spec_engine(path, _mtp(2), cuda_graph_max_batch=8, cuda_graph_max_len=64,
                          graph_capture=eager_capture)
    try:
        got = run_to_completion(engine, {  # type: ignore[arg-type]
            0: [greedy("a", list(SPEC_PROMPTS[0]), 20)],
            2: [greedy("b", list(SPEC_PROMPTS[2]), 16)]})
        replays = engine.runner.graphs.replays  # type: ignore[attr-defined]
    finally:
        engine.close()  # type: ignore[attr-defined]
    assert got == {"a": reference_greedy(model, list(SPEC_PROMPTS[0]), 20),
                   "b": reference_greedy(model, list(SPEC_PROMPTS[2]), 16)}
    assert any(rows >= 4 for rows, _ in replays)  # (3 rows and up pad to 4)
