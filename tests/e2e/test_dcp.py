"""Decode context parallelism with real peer processes: logits and greedy outputs equal
D = 1 and transformers; the group's KV capacity is D times a rank's."""

from __future__ import annotations

import httpx
import pytest
import torch

from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from switchyard.serve_process import Served
from tests.support.engines import (
    ENGINE,
    dcp_engine,
    greedy,
    prompts,
    reference_greedy,
    run_to_completion,
)
from tests.support.serving import concurrent_greedy

pytestmark = pytest.mark.timeout(300)
SMALL_BUDGET = 16 * 12288  # per rank: 16 blocks, 256 tokens




@pytest.mark.parametrize(("size", "interleave"), [(2, 1), (3, 1), (2, 16)],
                         ids=["d2", "d3", "d2-block-interleave"])
def test_logits_and_greedy_equal_d1_and_transformers(qwen3_ckpt: tuple, size: int,
                                                     interleave: int) -> None:
    path, model = qwen3_ckpt
    ps = prompts(seed=51, lengths=(70, 5, 33))  # several 16-token blocks; chunked prefill
    single = build_engine(AttentionConfig(model=path, **ENGINE))  # type: ignore[arg-type]
    arrivals = {0: [greedy("a", ps[0], 20), greedy("b", ps[1], 20)],
                6: [greedy("c", ps[2], 12)]}  # arrives while a and b decode
    with dcp_engine(path, size, interleave) as engine:
        for prompt in ps:
            got = engine.score(prompt)
            with torch.no_grad():
                want = model(torch.tensor([prompt])).logits[0]
            assert (got - want).abs().max() < 1e-4
            assert (got - single.score(prompt)).abs().max() < 1e-4
        outputs = run_to_completion(engine, arrivals)
    assert outputs == run_to_completion(single, arrivals)
    assert outputs == {name: reference_greedy(model, prompt, n)
                       for name, prompt, n in (("a", ps[0], 20), ("b", ps[1], 20),
                                               ("c", ps[2], 12))}


def test_prompt_logprobs_across_the_group_equal_transformers(qwen3_ckpt: tuple) -> None:
    """Prompt rows scored on the leader, whose hidden states merge every rank's shard."""
    from common.messages import GenerateRequest, SamplingParams

    path, model = qwen3_ckpt
    prompt = prompts(seed=55, lengths=(45,))[0]  # chunks of 16, over two ranks' shards
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].log_softmax(-1)  # [L, V]
    with dcp_engine(path, 2) as engine:
        params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
        assert engine.add(GenerateRequest("p", prompt, params)) is None
        sent = [d.prompt_logprobs for _ in range(20) for d in engine.step()
                if d.prompt_logprobs is not None]
    assert len(sent) == 1 and len(sent[0]) == len(prompt) and sent[0][0] is None
    got = torch.tensor([e.logprob for e in sent[0][1:]])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (got - want).abs().max() < 1e-4
    assert [e.top_ids[0] for e in sent[0][1:]] == ref[:-1].argmax(-1).tolist()


def test_each_rank_holds_its_share_of_a_long_request(qwen3_ckpt: tuple) -> None:
    path, _ = qwen3_ckpt
    with dcp_engine(path, 2) as engine:
        assert engine.add(greedy("long", prompts(seed=52, lengths=(200,))[0], 90)) is None
        seq = engine._seqs["long"]
        while seq.num_output_tokens < 89:
            engine.step()
        total = seq.num_computed_tokens
        per_rank = [len(t) for t in seq.block_tables]  # blocks held on each rank
        bm = engine.block_manager
        assert [bm.blocks_per_rank - bm.free_blocks(r) for r in range(2)] == per_rank
        for blocks in per_rank:  # within one block of total / D
            assert abs(blocks * bm.block_size - total / 2) <= bm.block_size
        while engine.has_work():
            engine.step()
        assert bm.num_free_blocks == bm.num_blocks




def test_a_prompt_too_long_for_one_rank_is_served_by_two(qwen3_ckpt: tuple) -> None:
    path, model = qwen3_ckpt
    prompt = prompts(seed=53, lengths=(300,))[0]  # > 256 tokens: one rank's whole budget
    flags = ["--model", str(path), "--dispatch-backend", "local", "--kv-cache-memory",
             str(SMALL_BUDGET), "--max-num-batched-tokens", "64"]
    with Served(flags) as one:
        name = httpx.get(f"{one.url}/v1/models").json()["data"][0]["id"]
        assert httpx.get(f"{one.url}/v1/models").json()["data"][0]["max_model_len"] == 256
        r = httpx.post(f"{one.url}/v1/completions", timeout=60, json={
            "model": name, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 400 and "maximum context length is 256" in r.text
    with Served([*flags, "--dcp-size", "2"]) as two:
        card = httpx.get(f"{two.url}/v1/models").json()["data"][0]
        assert card["max_model_len"] == 512
        assert concurrent_greedy(two.url, name, [prompt], 8) == \
            [reference_greedy(model, prompt, 8)]


def test_preemption_by_recompute_across_the_group(qwen3_ckpt: tuple) -> None:
    path, _ = qwen3_ckpt
    ps = prompts(seed=54, lengths=(40, 36, 44, 38))
    arrivals = {0: [greedy(f"r{i}", p, 30) for i, p in enumerate(ps)]}
    want = run_to_completion(build_engine(AttentionConfig(model=path, **ENGINE)), arrivals)  # type: ignore[arg-type]
    # 6 blocks per rank (96 tokens): the four requests (~280 tokens) cannot all stay.
    with dcp_engine(path, 2, kv_cache_memory=6 * 12288) as engine:
        assert run_to_completion(engine, arrivals) == want
        assert engine.scheduler.num_preemptions > 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_aborting_queued_and_running_requests_frees_every_block(qwen3_ckpt: tuple) -> None:
    """Aborts of requests still waiting (never given blocks), running, and preempted, then
    an engine failure with requests waiting: nothing raises, every block comes back."""
    path, _ = qwen3_ckpt
    with dcp_engine(path, 2, kv_cache_memory=6 * 12288) as engine:
        for i, p in enumerate(prompts(seed=55, lengths=(40, 36, 44, 38, 30))):
            assert engine.add(greedy(f"r{i}", p, 30)) is None
        assert engine.abort("r4") is not None  # waiting: never probed for blocks
        for _ in range(6):
            engine.step()
        assert {s.status.name for s in engine._seqs.values()} >= {"RUNNING"}
        for rid in ("r0", "r3"):
            assert engine.abort(rid) is not None
        assert engine.add(greedy("late", prompts(seed=56, lengths=(20,))[0], 8)) is None
        deltas = engine.fail_all("a test failure")  # running and waiting ones alike
        assert {d.request_id for d in deltas} == {"r1", "r2", "late"}
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not engine.has_work()


def _peer_steps(port: int, results: object) -> None:
    """Rank 1 of a two-rank group: two MoE calls, each after a plan; what it got."""
    from dcp.group import DcpGroup, GroupExperts, StepAborted

    group = DcpGroup(("127.0.0.1", port), 1, 2)
    experts, got = GroupExperts(group, None), []
    try:
        while not group.receive_plan().stop:
            try:
                got.append(experts(0, torch.zeros(3, 4), torch.zeros(3, 1), torch.ones(3, 1))
                           .tolist())
            except StepAborted as exc:
                got.append(str(exc))
    finally:
        group.close()
        results.put(got)  # type: ignore[attr-defined]


def test_a_failed_expert_call_on_the_leader_aborts_the_step_on_every_rank() -> None:
    """The leader's experts fail on the first step: the peer drops that step (before, it
    kept waiting for the outputs and then read the next plan's size as them) and gets the
    second step's outputs."""
    import multiprocessing

    from common.messages import DcpPlan
    from common.ports import free_port
    from dcp.group import DcpGroup, GroupExperts, StepAborted
    from ep_dispatch.rpc_pool import ExpertRankError

    calls = []

    def inner(layer: int, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(layer)
        if len(calls) == 1:
            raise ExpertRankError("expert rank 1 failed on layer 0")
        return torch.arange(12, dtype=x.dtype).view(3, 4)

    ctx = multiprocessing.get_context("spawn")
    port, results = free_port(), ctx.Queue()
    peer = ctx.Process(target=_peer_steps, args=(port, results))
    peer.start()
    try:
        group = DcpGroup(("127.0.0.1", port), 0, 2)
        experts = GroupExperts(group, inner)  # type: ignore[arg-type]
        x = torch.zeros(3, 4)
        try:
            group.send_plan(DcpPlan([]))
            with pytest.raises(StepAborted, match="expert rank 1 failed on layer 0") as failed:
                experts(0, x, torch.zeros(3, 1), torch.ones(3, 1))
            assert isinstance(failed.value.__cause__, ExpertRankError)
            group.send_plan(DcpPlan([]))
            y = experts(0, x, torch.zeros(3, 1), torch.ones(3, 1))
            group.send_plan(DcpPlan([], stop=True))
        finally:
            group.close()
        got = results.get(timeout=60)
    finally:
        peer.join(timeout=30)
        if peer.is_alive():
            peer.kill()
    assert got == ["the leader's expert call failed on layer 0", y.tolist()]
    assert y.tolist() == torch.arange(12.0).view(3, 4).tolist()


def _heartbeat_rank(port: int, rank: int, op_timeout: float, out: object, go: object
                    ) -> None:
    """Rank 0 heartbeats, then once told (`go`) again (how long it took to fail reported);
    rank 1 answers until stopped."""
    import time

    from dcp.group import DcpGroup

    group = DcpGroup(("127.0.0.1", port), rank, 2, op_timeout=op_timeout)
    if rank == 1:
        while group.receive_plan().heartbeat:
            group.answer_heartbeat()
            out.put("answered")  # type: ignore[attr-defined]
        return
    group.heartbeat()
    out.put("answered")  # type: ignore[attr-defined]
    go.get(timeout=60)  # type: ignore[attr-defined]  # (the test stopped the peer)
    start = time.monotonic()
    try:
        group.heartbeat()
    except RuntimeError as exc:
        out.put((time.monotonic() - start, str(exc)[:200]))  # type: ignore[attr-defined]
    else:
        out.put(None)  # type: ignore[attr-defined]


def test_an_idle_leader_finds_a_silent_peer_by_its_heartbeat() -> None:
    """A DCP group with a 2 s collective timeout: heartbeats answered while the peer
    runs; the peer stopped (SIGSTOP: silent, its connections open, as behind a cut
    link), the leader's next heartbeat fails within the timeout (and a second of slack),
    where before a leader idled forever without noticing."""
    import multiprocessing
    import os
    import signal

    from common.ports import free_port

    ctx = multiprocessing.get_context("spawn")
    port, leader_out, peer_out, go = free_port(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    ranks = [ctx.Process(target=_heartbeat_rank, args=(port, r, 2.0, q, go))
             for r, q in ((0, leader_out), (1, peer_out))]
    for p in ranks:
        p.start()
    try:
        assert leader_out.get(timeout=60) == peer_out.get(timeout=60) == "answered"
        os.kill(ranks[1].pid, signal.SIGSTOP)
        go.put("go")
        got = leader_out.get(timeout=60)
        assert got is not None, "the heartbeat to a silent peer did not fail"
        seconds, error = got
        assert 1.5 <= seconds <= 3.0, (seconds, error)
    finally:
        for p in ranks:
            p.kill()
            p.join(timeout=30)
