"""Expert services as real processes on loopback, reached through the `rpc` backend."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import torch

from common.ports import free_port
from ep_dispatch.local import LocalExperts
from ep_dispatch.placement import Placement
from ep_dispatch.rpc import RpcExperts
from ep_dispatch.rpc_pool import ExpertRankError
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine
from services.attention.micro_batches import CANDIDATES, PROBE_STEPS
from services.model.checkpoint import Checkpoint
from services.model.config import ModelConfig
from services.model.experts import ExpertBank, all_experts
from switchyard.children import Children
from switchyard.serve_process import Served
from tests.support.delay_proxy import DelayProxy
from tests.support.engines import (
    greedy,
    prompts,
    reference_greedy,
    run_to_completion,
    start_experts,
)
from tests.support.serving import concurrent_greedy, served_greedy
from tests.support.tools import wait_until

pytestmark = pytest.mark.timeout(300)
NUM_RANKS = 3




@pytest.fixture(scope="module")
def qwen3_experts(qwen3_ckpt: tuple) -> Iterator[list[tuple[str, int]]]:
    children, addresses = start_experts(qwen3_ckpt[0], NUM_RANKS)
    yield addresses
    children.stop()


def rpc_engine(path: Path, addresses: list[tuple[str, int]], **kw: object) -> Engine:
    return build_engine(AttentionConfig(model=path, dispatch_backend="rpc",
                                  expert_addresses=tuple(addresses), max_num_batched_tokens=8,
                                  kv_cache_memory=1 << 22, **kw))  # type: ignore[arg-type]


def test_rpc_dispatch_equals_local_across_processes(qwen3_ckpt: tuple,
                                                    qwen3_experts: list) -> None:
    path = qwen3_ckpt[0]
    cfg = ModelConfig.from_dir(path)
    moe = cfg.moe_layer_ids
    bank = ExpertBank(cfg, Checkpoint(path), all_experts(cfg), torch.float32)
    local = LocalExperts(cfg.num_experts, bank.forward)
    remote = RpcExperts(Placement.balanced(moe, cfg.num_experts, NUM_RANKS), qwen3_experts)
    try:
        g = torch.Generator().manual_seed(0)
        for tokens, top_k in [(0, 2), (1, 1), (17, 2), (64, 8)]:
            x = torch.randn(tokens, cfg.hidden_size, generator=g)
            ids = torch.rand(tokens, cfg.num_experts, generator=g).topk(top_k).indices
            w = torch.rand(tokens, top_k, generator=g)
            for layer in moe:
                assert torch.allclose(remote(layer, x, ids, w), local(layer, x, ids, w),
                                      atol=1e-6)
        # All tokens to one expert: only its rank works.
        x = torch.randn(9, cfg.hidden_size, generator=g)
        ids = torch.full((9, 1), 4)
        w = torch.ones(9, 1)
        assert torch.allclose(remote(0, x, ids, w), local(0, x, ids, w), atol=1e-6)
    finally:
        remote.close()


def test_each_expert_service_holds_only_its_share(qwen3_ckpt: tuple,
                                                  qwen3_experts: list) -> None:
    cfg = ModelConfig.from_dir(qwen3_ckpt[0])
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4  # float32 bytes
    total = per_expert * cfg.num_experts * sum(cfg.moe_layers)
    engine = rpc_engine(qwen3_ckpt[0], qwen3_experts)
    try:
        held = [info.weight_bytes for info in engine.runner.experts.pool.infos]
    finally:
        engine.close()
    assert sum(held) == total
    for b in held:  # balanced: within one expert per MoE layer of total / N
        assert abs(b - total / NUM_RANKS) <= per_expert * sum(cfg.moe_layers)


def test_logits_and_greedy_through_expert_processes(qwen3_ckpt: tuple,
                                                    qwen3_experts: list) -> None:
    path, model = qwen3_ckpt
    engine = rpc_engine(path, qwen3_experts)
    try:
        for prompt in prompts(lengths=(5, 19, 40)):
            with torch.no_grad():
                ref = model(torch.tensor([prompt])).logits[0]
            assert (engine.score(prompt) - ref).abs().max().item() < 1e-4
        ps = prompts(seed=21, lengths=(12, 3, 30, 21))
        got = run_to_completion(engine, {0: [greedy("a", ps[0]), greedy("b", ps[1])],
                                         4: [greedy("c", ps[2])], 11: [greedy("d", ps[3])]})
    finally:
        engine.close()
    assert got == {rid: reference_greedy(model, p, 32) for rid, p in zip("abcd", ps,
                                                                          strict=True)}


def test_micro_batches_pipeline_to_the_same_bits(qwen3_ckpt: tuple,
                                                qwen3_experts: list) -> None:
    """`--micro-batches 2` and `3` (the ping-pong pipeline over the expert services):
    every step's logits bit for bit those of `--micro-batches 1`, on decodes and on prefill
    chunks, and greedy outputs transformers'."""
    path, model = qwen3_ckpt
    ps = prompts(seed=5, lengths=(12, 3, 30, 21, 7))
    arrivals = {0: [greedy("a", ps[0]), greedy("b", ps[1]), greedy("c", ps[2])],
                3: [greedy("d", ps[3])], 9: [greedy("e", ps[4])]}
    logits: dict[str, list[torch.Tensor]] = {}
    outputs: dict[str, dict] = {}
    pipelined: dict[str, int] = {}
    for setting in ("1", "2", "3"):
        engine = rpc_engine(path, qwen3_experts, micro_batches=setting, max_num_seqs=8)
        seen = logits.setdefault(setting, [])
        pipelined[setting] = 0
        forward, logits_of = engine.runner.model.forward_pipelined, engine.runner.model.logits

        def count(*args: object, forward: object = forward, setting: str = setting) -> object:
            pipelined[setting] += 1
            return forward(*args)  # type: ignore[operator]

        def record(hidden: torch.Tensor, logits_of: object = logits_of,
                   seen: list = seen) -> torch.Tensor:
            seen.append(logits_of(hidden))  # type: ignore[operator]
            return seen[-1]

        engine.runner.model.forward_pipelined = count  # type: ignore[method-assign]
        engine.runner.model.logits = record  # type: ignore[method-assign]
        try:
            outputs[setting] = run_to_completion(
                engine, {k: [msgspec.structs.replace(r) for r in v] for k, v in arrivals.items()})
        finally:
            engine.close()
    assert pipelined["1"] == 0 and pipelined["2"] > 10 and pipelined["3"] > 10
    for setting in ("2", "3"):
        assert len(logits[setting]) == len(logits["1"])
        for got, want in zip(logits[setting], logits["1"], strict=True):
            assert torch.equal(got, want)
        assert outputs[setting] == outputs["1"]
    assert outputs["1"] == {rid: reference_greedy(model, p, 32)
                            for rid, p in zip("abcde", ps, strict=True)}


def test_one_micro_batch_computes_while_the_others_exchange_is_on_the_wire(
        qwen3_ckpt: tuple, qwen3_experts: list) -> None:
    """With 0.1 s added each way between the engine and every expert service, a step of 2
    micro-batches A and B, each MoE layer l: B's attention for layer l starts after A's
    layer-l call left and before its answer was back, and A's next attention starts
    before B's layer-l answer was back (ordered by the step's own timeline, not by wall
    clock). The round trip the backend measures is the proxies' 0.2 s."""
    path = qwen3_ckpt[0]
    moe = ModelConfig.from_dir(path).moe_layer_ids
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(DelayProxy(a, delay_s=0.1)) for a in qwen3_experts]
        engine = rpc_engine(path, [p.address for p in proxies], micro_batches="2")
        stack.callback(engine.close)
        for i, prompt in enumerate(prompts(seed=23, lengths=(5, 6, 7, 8))):
            engine.add(greedy(f"r{i}", prompt, 4))
        engine.step()  # the prompts
        engine.step()  # a decode
        timeline = engine.runner.last_timeline
        assert timeline is not None and timeline.micro_batches() == [0, 1]
        for layer in moe:
            a_call, b_call = (timeline.find("exchange", j, layer) for j in (0, 1))
            b_attention = timeline.find("attention", 1, layer)
            assert a_call.start <= b_attention.start < a_call.end
            following = [i for i in timeline.intervals if i.kind == "attention"
                         and i.micro_batch == 0 and i.start >= a_call.end]
            assert following[0].start < b_call.end
        assert engine.runner.experts.round_trip_s() is None  # no one-batch call yet
        solo = rpc_engine(path, [p.address for p in proxies], micro_batches="1")
        stack.callback(solo.close)
        solo.add(greedy("solo", [1, 2, 3], 2))
        solo.step()
        assert 0.2 <= solo.runner.experts.round_trip_s() < 0.3


def test_auto_times_each_count_behind_a_long_wire(qwen3_ckpt: tuple,
                                                  qwen3_experts: list) -> None:
    """`--micro-batches auto` with 0.05 s added each way: the decode steps of 4 sequences
    run as 1, 2 and 3 micro-batches `PROBE_STEPS` times each, then as the one the tuner
    kept. (Whether it tries at all is the wire's share of a step, `test_micro_batches`.)"""
    path = qwen3_ckpt[0]
    asked: list[int] = []  # the counts of the decode steps of all four
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(DelayProxy(a, delay_s=0.05)) for a in qwen3_experts]
        engine = rpc_engine(path, [p.address for p in proxies], micro_batches="auto")
        stack.callback(engine.close)
        choose = engine.runner.tuner.choose

        def record(tokens: int, seqs: int, round_trip: float | None) -> int:
            count = choose(tokens, seqs, round_trip)
            if tokens == seqs == 4:
                asked.append(count)
            return count

        engine.runner.tuner.choose = record  # type: ignore[method-assign]
        for i, prompt in enumerate(prompts(seed=24, lengths=(5, 6, 7, 8))):
            engine.add(greedy(f"r{i}", prompt, PROBE_STEPS * len(CANDIDATES) + 8))
        while engine.has_work():
            engine.step()
    probed = PROBE_STEPS * len(CANDIDATES)
    assert asked[:probed] == [c for c in CANDIDATES for _ in range(PROBE_STEPS)]
    assert len(set(asked[probed:])) == 1


def test_replicated_placement_from_a_file(mixtral_ckpt: tuple, tmp_path: Path) -> None:
    path, model = mixtral_ckpt
    cfg = ModelConfig.from_dir(path)
    # Expert 0 on every rank, the rest round-robin: replicas share expert 0's tokens.
    layers = {str(i): [[0, 1]] + [[e % 2] for e in range(1, cfg.num_experts)]
              for i in range(cfg.num_layers)}
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"num_ranks": 2, "layers": layers}))
    children, addresses = start_experts(path, 2, placement)
    try:
        engine = rpc_engine(path, addresses, placement=placement)
        try:
            prompt = prompts(seed=4, lengths=(33,))[0]
            with torch.no_grad():
                ref = model(torch.tensor([prompt])).logits[0]
            assert (engine.score(prompt) - ref).abs().max().item() < 1e-4
        finally:
            engine.close()
    finally:
        children.stop()


def expert_command(path: Path, rank: int, num_ranks: int, placement: Path, port: int = 0
                   ) -> list[str]:
    return ["expert", "--model", str(path), "--rank", str(rank), "--num-ranks",
            str(num_ranks), "--num-threads", "1", "--placement", str(placement), "--port",
            str(port)]


def test_a_lost_expert_rank_is_routed_around_while_its_experts_have_replicas(
        qwen3_ckpt: tuple, tmp_path: Path) -> None:
    """Each expert on 2 of 3 expert services: with one killed, the engine's layer calls
    go to the replicas (logits still transformers'), and once it is started again it is
    probed back into the routing and receives rows again."""
    path, model = qwen3_ckpt
    cfg = ModelConfig.from_dir(path)
    placement = tmp_path / "placement.json"
    placement.write_text(Placement.balanced(cfg.moe_layer_ids, cfg.num_experts, 3,
                                            replicas=2).to_json())
    prompt = prompts(seed=8, lengths=(21,))[0]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    children, restarted = Children(), Children()
    try:
        ports = children.start_all([(f"expert {r}", expert_command(path, r, 3, placement))
                                    for r in range(3)], timeout=120)
        addresses = [("127.0.0.1", p) for p, *_ in ports]
        engine = rpc_engine(path, addresses, placement=placement, expert_timeout=10)
        client: RpcExperts = engine.runner.experts  # type: ignore[assignment]
        called: list[int] = []
        send = client._send

        def counted(rank: int, *args: object) -> tuple[list[int], float]:
            called.append(rank)
            return send(rank, *args)  # type: ignore[arg-type]

        client._send = counted  # type: ignore[method-assign]
        try:
            assert (engine.score(prompt) - ref).abs().max().item() < 1e-4
            assert set(called) == {0, 1, 2}
            lost = children.procs[1][1]
            lost.kill()
            lost.wait()
            called.clear()
            assert (engine.score(prompt) - ref).abs().max().item() < 1e-4
            assert client.pool.lost == {1} and client.ready()  # /health: still serving
            assert "expert rank 1" in next(line for line in client.describe()
                                           if "lost: routed to replicas" in line)
            called.clear()
            assert (engine.score(prompt) - ref).abs().max().item() < 1e-4
            assert 1 not in called  # routed around, no call waits on it
            restarted.start_all([("expert 1", expert_command(path, 1, 3, placement,
                                                             ports[1][0]))], timeout=120)
            deadline = time.monotonic() + 60  # the probe retries every second or so
            while client.pool.lost and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not client.pool.lost and client.pool.conns[1] is not None
            called.clear()
            assert (engine.score(prompt) - ref).abs().max().item() < 1e-4
            assert 1 in called
        finally:
            engine.close()
    finally:
        children.stop()
        restarted.stop()


def test_an_expert_rank_killed_mid_pipeline_loses_no_request(qwen3_ckpt: tuple,
                                                              tmp_path: Path) -> None:
    """`--micro-batches 2` with each expert on 2 of 3 expert services: one killed while
    both micro-batches' exchanges are in flight, every request still ends with
    transformers' greedy tokens (its rows sent again to the replicas)."""
    path, model = qwen3_ckpt
    cfg = ModelConfig.from_dir(path)
    placement = tmp_path / "placement.json"
    placement.write_text(Placement.balanced(cfg.moe_layer_ids, cfg.num_experts, 3,
                                            replicas=2).to_json())
    ps = prompts(seed=13, lengths=(9, 14, 5, 22))
    children = Children()
    try:
        ports = children.start_all([(f"expert {r}", expert_command(path, r, 3, placement))
                                    for r in range(3)], timeout=120)
        engine = rpc_engine(path, [("127.0.0.1", p) for p, *_ in ports], placement=placement,
                            expert_timeout=10, micro_batches="2")
        client: RpcExperts = engine.runner.experts  # type: ignore[assignment]
        starts = 0
        start = client.start

        def kill_once_in_flight(*args: object) -> object:
            nonlocal starts
            starts += 1
            exchange = start(*args)  # type: ignore[arg-type]
            if starts == 40:  # mid-generation, the other micro-batch's calls sent too
                lost = children.procs[1][1]
                lost.kill()
                lost.wait()
            return exchange

        client.start = kill_once_in_flight  # type: ignore[method-assign]
        try:
            got = run_to_completion(engine, {0: [greedy(rid, p) for rid, p
                                                 in zip("abcd", ps, strict=True)]})
            assert starts > 40 and client.pool.lost == {1}
        finally:
            engine.close()
    finally:
        children.stop()
    assert got == {rid: reference_greedy(model, p, 32) for rid, p in zip("abcd", ps,
                                                                          strict=True)}


def test_serve_starts_a_lost_expert_service_again(qwen3_ckpt: tuple) -> None:
    """`serve` (rpc) restarts an expert service that dies, on its ports, as compose's
    restart policy does; with every expert on two services no request fails meanwhile."""
    import os
    import signal

    from switchyard.serve_process import child_pids

    path, model = qwen3_ckpt
    ps = prompts(seed=17, lengths=(9, 14))
    want = [reference_greedy(model, p, 6) for p in ps]
    with Served(["--model", str(path), "--expert-services", "3", "--expert-replicas",
                 "2"]) as served:
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        rank_1 = served.services()["expert rank 1"]
        assert concurrent_greedy(served.url, name, ps, 6) == want
        os.kill(rank_1, signal.SIGKILL)
        assert concurrent_greedy(served.url, name, ps, 6) == want  # on the replicas

        def back() -> bool:
            lines = httpx.get(f"{served.url}/health", timeout=30).json()["attention"][0][
                "experts"]
            return len(child_pids(served.proc.pid)) == len(served.children) and all(
                line.endswith(", connected") for line in lines)

        wait_until(back, 120, lambda: f"expert rank 1 back: {served.stderr()[-2000:]}")
        assert concurrent_greedy(served.url, name, ps, 6) == want
        assert "expert rank 1 exited with status -9; starting it again" in served.stderr()


def test_without_a_replica_a_lost_rank_fails_the_call(qwen3_ckpt: tuple,
                                                      tmp_path: Path) -> None:
    path, _ = qwen3_ckpt
    cfg = ModelConfig.from_dir(path)
    placement = tmp_path / "placement.json"  # expert 0 on both ranks, the rest on one
    placement.write_text(json.dumps({"num_ranks": 2, "layers": {
        str(i): [[0, 1]] + [[e % 2] for e in range(1, cfg.num_experts)]
        for i in cfg.moe_layer_ids}}))
    children = Children()
    try:
        ports = children.start_all([(f"expert {r}", expert_command(path, r, 2, placement))
                                    for r in range(2)], timeout=120)
        client = RpcExperts(Placement.load(placement, cfg.moe_layer_ids, cfg.num_experts),
                            [("127.0.0.1", p) for p, *_ in ports], call_timeout=2)
        try:
            lost = children.procs[1][1]
            lost.kill()
            lost.wait()
            x, w = torch.randn(4, cfg.hidden_size), torch.ones(4, 1)
            with pytest.raises(ExpertRankError, match="expert rank 1 at"):
                client(cfg.moe_layer_ids[0], x, torch.tensor([[1], [3], [0], [5]]), w)
            assert not client.pool.lost  # nothing routed around: it is called (and fails) again
            zeros = torch.zeros(4, 1, dtype=torch.int64)  # expert 0: rank 0 also has it
            with pytest.raises(ExpertRankError, match="expert rank 1"):
                client(cfg.moe_layer_ids[0], x, zeros, w)  # (turns put some rows on 1)
        finally:
            client.close()
    finally:
        children.stop()


def test_unreachable_expert_rank_is_named(qwen3_ckpt: tuple, qwen3_experts: list) -> None:
    port = free_port()  # nothing listens here
    with pytest.raises(ExpertRankError, match=rf"expert rank 2 at 127\.0\.0\.1:{port}"):
        build_engine(AttentionConfig(model=qwen3_ckpt[0], dispatch_backend="rpc",
                               expert_addresses=(*qwen3_experts[:2], ("127.0.0.1", port)),
                               kv_cache_memory=1 << 20, expert_timeout=1.0))


def test_expert_service_rejects_a_placement_that_leaves_an_expert_out(
        qwen3_ckpt: tuple, tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(qwen3_ckpt[0])
    layers = {str(i): [[0]] * (cfg.num_experts - 1) + [[]] for i in cfg.moe_layer_ids}
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"num_ranks": 1, "layers": layers}))
    proc = subprocess.run([sys.executable, "-m", "switchyard", "expert", "--model",
                           str(qwen3_ckpt[0]), "--placement", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"expert {cfg.num_experts - 1} is unplaced" in proc.stderr


def test_serve_rejects_an_unknown_backend(qwen3_ckpt: tuple) -> None:
    proc = subprocess.run([sys.executable, "-m", "switchyard", "serve", "--model",
                           str(qwen3_ckpt[0]), "--port", "0",
                           "--dispatch-backend", "carrier-pigeon"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert ("unknown dispatch backend 'carrier-pigeon'; available: deepep, local, nccl, rpc, "
            "torch"
            in proc.stderr)


@pytest.mark.parametrize(("family", "flags"), [
    ("mixtral", ["--expert-services", "3", "--attention-groups", "2"]),  # rpc, the default
    # both groups' ping-pong pipelines through the same expert services at once
    ("qwen3", ["--expert-services", "2", "--attention-groups", "2", "--micro-batches", "2"]),
    ("qwen3", ["--dispatch-backend", "torch", "--expert-services", "3",
               "--attention-groups", "2"]),
    # lockstep: the groups agree on each step's rounds, a group with fewer joins with none
    ("mixtral", ["--dispatch-backend", "torch", "--expert-services", "2",
                 "--attention-groups", "2", "--micro-batches", "2"]),
    # a DCP group's peers run the leader's split: its collectives in the same order
    ("mixtral", ["--dcp-size", "2", "--expert-services", "2", "--micro-batches", "2"]),
    ("qwen3", ["--dispatch-backend", "local"])])
def test_serve_topologies_match_transformers(request: pytest.FixtureRequest, family: str,
                                             flags: list[str]) -> None:
    """Each topology with one of the two models, three each: the topology's mechanics do
    not depend on the model (tests/services covers each family's numerics in process)."""
    path, model = request.getfixturevalue(f"{family}_ckpt")
    ps = prompts(seed=31, lengths=(2, 37, 15, 8, 26, 11))
    got, health, samples = served_greedy(path, flags, ps, max_tokens=16)
    assert got == [reference_greedy(model, p, 16) for p in ps]
    groups = 2 if "--attention-groups" in flags else 1
    assert len(health["attention"]) == groups and all(a["ready"] for a in health["attention"])
    experts = health["attention"][0]["experts"]
    assert len(experts) == (1 if "local" in flags else 3 - ("--micro-batches" in flags))
    steps = sum(samples["switchyard:engine_step_seconds_count"].values())
    micro = sum(samples["switchyard:micro_batches_total"].values())
    if "--micro-batches" in flags:  # most steps hold 2 or more of a group's 3 sequences
        assert steps < micro <= 2 * steps
    elif "local" in flags:  # nothing to overlap
        assert micro == steps
    else:  # auto: the tuner may time pipelines where the wire is a tenth of a tiny step
        assert micro >= steps
    assert all("expert rank" in e or "in-process" in e for e in experts)


NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'


@pytest.mark.parametrize("flags", [
    ["--expert-services", "3", "--micro-batches", "2"],  # rpc, the ping-pong pipeline
    ["--dispatch-backend", "torch", "--expert-services", "2"],  # lockstep rounds
    ["--dcp-size", "2", "--expert-services", "2"],  # drafts' KV over a DCP group's ranks
])
def test_speculation_keeps_transformers_greedy_tokens_served(qwen3_ckpt: tuple,
                                                             flags: list[str]) -> None:
    """`serve --speculative-config` with n-gram drafts of up to 3 tokens: transformers'
    greedy tokens in each topology, and drafts accepted."""
    path, model = qwen3_ckpt
    ps = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [1, 2, 3, 1, 2, 3, 1], [40, 41, 17, 99, 3]]
    got, _, samples = served_greedy(path, [*flags, "--speculative-config", NGRAM], ps,
                                    max_tokens=24)
    assert got == [reference_greedy(model, p, 24) for p in ps]
    assert sum(samples["switchyard:spec_decode_num_accepted_tokens_total"].values()) > 0


MTP = '{"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": null}'


@pytest.mark.parametrize("flags", [
    ["--expert-services", "3", "--micro-batches", "2"],  # rpc, the ping-pong pipeline
    ["--dispatch-backend", "local", "--enable-prefix-caching"],
    ["--dcp-size", "2", "--expert-services", "2"],  # the MTP's KV and passes on both ranks
    # lockstep: each MTP pass a round of its own, the layers it does not call joined empty
    ["--dispatch-backend", "torch", "--expert-services", "2"],
])
def test_mtp_speculation_keeps_transformers_greedy_tokens_served(
        deepseek_v3_mtp_ckpt: tuple, flags: list[str]) -> None:
    """`serve --speculative-config` with MTP drafts of up to 2 tokens over a DeepSeek-V3
    with its MTP layer: transformers' greedy tokens, drafts verified, and the MTP layer's
    experts served and counted as any layer's (its tokens per expert in /metrics)."""
    path, model, _ = deepseek_v3_mtp_ckpt
    ps = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [1, 2, 3, 1, 2, 3, 1], [40, 41, 17, 99, 3]]
    got, _, samples = served_greedy(path, [*flags, "--speculative-config", MTP], ps,
                                    max_tokens=20)
    assert got == [reference_greedy(model, p, 20) for p in ps]
    assert sum(samples["switchyard:spec_decode_num_draft_tokens_total"].values()) > 0
    n = model.config.num_hidden_layers
    assert sum(v for k, v in samples["switchyard:expert_tokens_total"].items()
               if dict(k).get("layer") == str(n)) > 0


def test_mtp_with_w4a4_experts_keeps_the_greedy_tokens(deepseek_v3_mtp_ckpt: tuple) -> None:
    """W4A4 experts (the MTP layer's too) over rpc: the same greedy tokens with MTP
    drafts as without."""
    path = deepseek_v3_mtp_ckpt[0]
    ps = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [40, 41, 17, 99, 3]]
    flags = ["--quantization", "w4a4", "--expert-services", "2"]
    off, _, _ = served_greedy(path, flags, ps, max_tokens=16)
    on, _, samples = served_greedy(path, [*flags, "--speculative-config", MTP], ps,
                                   max_tokens=16)
    assert on == off
    assert sum(samples["switchyard:spec_decode_num_draft_tokens_total"].values()) > 0


def test_torch_backend_across_processes(qwen3_ckpt: tuple) -> None:
    """This process is attention rank 0 of a gloo world with 3 expert-rank processes."""
    path, model = qwen3_ckpt
    port = free_port()
    children = Children()
    # Expert ranks report ready only once the whole world (this rank too) has joined.
    pending = [children.spawn(f"expert {r}", [
        "expert", "--model", str(path), "--rank", str(r), "--num-ranks", str(NUM_RANKS),
        "--num-threads", "1", "--dispatch-backend", "torch", "--dist-init",
        f"127.0.0.1:{port}"]) for r in range(NUM_RANKS)]
    try:
        engine = build_engine(AttentionConfig(model=path, dispatch_backend="torch",
                                        dist_init=("127.0.0.1", port), expert_ranks=NUM_RANKS,
                                        max_num_batched_tokens=8, kv_cache_memory=1 << 22,
                                        expert_timeout=120))
    except BaseException:
        children.stop()
        raise
    try:
        deadline = time.monotonic() + 60
        assert [children.wait_ports(p, deadline) for p in pending] == [(0,)] * NUM_RANKS
        cfg = engine.model_config
        moe = cfg.moe_layer_ids
        bank = ExpertBank(cfg, Checkpoint(path), all_experts(cfg), torch.float32)
        local = LocalExperts(cfg.num_experts, bank.forward)
        g = torch.Generator().manual_seed(0)
        for tokens, top_k in [(0, 2), (1, 1), (17, 2), (64, 8)]:
            x = torch.randn(tokens, cfg.hidden_size, generator=g)
            ids = torch.rand(tokens, cfg.num_experts, generator=g).topk(top_k).indices
            w = torch.rand(tokens, top_k, generator=g)
            # announce work, so that every rank runs the round (the 0-token call too)
            assert engine.runner.experts.begin_step(1)  # one round serves every MoE layer once
            for layer in moe:
                assert torch.allclose(engine.runner.experts(layer, x, ids, w),
                                      local(layer, x, ids, w), atol=1e-6)
        prompt = prompts(lengths=(29,))[0]
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0]
        assert (engine.score(prompt) - ref).abs().max().item() < 1e-4
    finally:
        engine.close()
        children.stop()






def test_expert_and_attention_services_on_a_taken_port_say_so(qwen3_ckpt: tuple) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for role in (["expert"], ["attention", "--dispatch-backend", "local"]):
            proc = subprocess.run([sys.executable, "-m", "switchyard", *role, "--model",
                                   str(qwen3_ckpt[0]), "--port", str(port)],
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2, proc.stderr
            assert f"switchyard {role[0]}: cannot listen on 127.0.0.1:{port}: Address already " \
                "in use" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_expert_rank_that_cannot_reach_the_rendezvous_says_so(qwen3_ckpt: tuple) -> None:
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "switchyard", "expert", "--model",
                           str(qwen3_ckpt[0]), "--dispatch-backend", "torch", "--dist-init",
                           f"127.0.0.1:{port}", "--rendezvous-timeout", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"cannot reach the rendezvous at 127.0.0.1:{port} (hosted by attention rank 0)" \
        in proc.stderr


def test_a_lockstep_attention_rank_whose_expert_rank_dies_exits_for_a_restart(
        qwen3_ckpt: tuple) -> None:
    """Services started one by one (as compose does), torch backend: when an expert rank
    dies, the attention rank's collectives fail, and it must exit (status 3) rather than
    run on with a world whose rounds can no longer pair up."""
    from services.attention.server import OUT_OF_STEP_EXIT

    path, _ = qwen3_ckpt
    port = free_port()
    children = Children()
    try:
        world = ["--dispatch-backend", "torch", "--dist-init", f"127.0.0.1:{port}"]
        pending = [children.spawn("expert 0", ["expert", "--model", str(path), "--rank", "0",
                                               "--num-ranks", "1", *world]),
                   children.spawn("attention 0", ["attention", "--model", str(path),
                                                  "--port", "0", "--expert-ranks", "1",
                                                  *world])]
        deadline = time.monotonic() + 120
        for p in pending:
            children.wait_ports(p, deadline)
        (_, expert), (_, attention) = children.procs
        expert.kill()
        assert attention.wait(timeout=60) == OUT_OF_STEP_EXIT
    finally:
        children.stop()
