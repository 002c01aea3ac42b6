"""Expert placement balanced by measured load (DeepSeek's EPLB), end to end."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from ep_dispatch.placement import Placement
from services.model.config import ModelConfig
from switchyard.serve_process import Served
from tests.support.engines import prompts, reference_greedy
from tests.support.metrics_text import scrape
from tests.support.serving import concurrent_greedy, stream_tokens

pytestmark = pytest.mark.timeout(300)


def test_a_placement_balanced_by_measured_load_serves_the_same_tokens(
        deepseek_v3_ckpt: tuple, tmp_path: Path) -> None:
    """Serve, measure the routing load from the running server's /stats, let EPLB place
    the experts with 2 redundant copies a layer over 2 expert services (`switchyard
    placement --load URL`), and serve with that placement: transformers' tokens still."""
    from switchyard.cli import main

    path, model = deepseek_v3_ckpt
    ps = prompts(seed=33, lengths=(30, 11, 19))
    want = [reference_greedy(model, p, 12) for p in ps]
    with Served(["--model", str(path), "--expert-services", "2"]) as served:
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        assert concurrent_greedy(served.url, name, ps, max_tokens=12) == want
        out = tmp_path / "placement.json"
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            assert main(["placement", "--model", str(path), "--expert-services", "2",
                         "--load", served.url, "--num-redundant-experts", "2", "--json"]) == 0
        out.write_text(printed.getvalue())
    cfg = ModelConfig.from_dir(path)
    placement = Placement.load(out, cfg.moe_layer_ids, cfg.num_experts)
    for copies in placement.replicas.values():
        assert sum(len(c) for c in copies) == cfg.num_experts + 2
        assert [sum(r == rank for c in copies for r in c) for rank in (0, 1)] == [5, 5]
    with Served(["--model", str(path), "--expert-services", "2", "--placement", str(out)]
                ) as served:
        assert concurrent_greedy(served.url, name, ps, max_tokens=12) == want


def _moved(num_experts: int, moe_layers: list[int], shift: int, extra: int) -> Placement:
    """Over 2 ranks: expert e on rank (e + shift) % 2, and expert `extra` on both."""
    experts = tuple(((e + shift) % 2,) if e != extra else (0, 1) for e in range(num_experts))
    return Placement(2, num_experts, dict.fromkeys(moe_layers, experts))


def test_greedy_tokens_stay_transformers_across_rebalances_mid_generation(
        deepseek_v3_ckpt: tuple) -> None:
    """Four greedy streams run while the experts move twice (to a placement with a
    redundant copy, then to another): each rebalance starts after every stream has its
    first tokens and ends (every group routing by the new placement) while they still
    run. Their tokens are transformers' before, during and after."""
    path, model = deepseek_v3_ckpt
    cfg = ModelConfig.from_dir(path)
    ps = prompts(seed=35, lengths=(30, 11, 19, 7))
    n = 160
    want = [reference_greedy(model, p, n) for p in ps]
    placements = [_moved(cfg.num_experts, cfg.moe_layer_ids, 1, 3),
                  _moved(cfg.num_experts, cfg.moe_layer_ids, 0, 6)]
    with Served(["--model", str(path), "--expert-services", "2", "--enable-eplb",
                 "--eplb-interval", "0", "--max-num-batched-tokens", "16"]) as served:
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        outs: list[dict] = [{} for _ in ps]
        firsts = [threading.Event() for _ in ps]
        body = {"max_tokens": n, "temperature": 0, "ignore_eos": True}
        threads = [threading.Thread(target=stream_tokens,
                                    args=(served.url, name, p, body, f, o))
                   for p, f, o in zip(ps, firsts, outs, strict=True)]
        for t in threads:
            t.start()
        try:
            assert all(f.wait(60) for f in firsts)
            records = []
            for placement in placements:
                r = httpx.post(f"{served.url}/eplb/rebalance", timeout=120,
                               json={"placement": json.loads(placement.to_json())})
                assert r.status_code == 200, r.text
                records.append(r.json()["rebalance"])
                stats = httpx.get(f"{served.url}/stats").json()
                assert stats["num_running"] == len(ps)  # switched mid-generation
                assert stats["placement_version"] == records[-1]["version"]
        finally:
            for t in threads:
                t.join(120)
        assert all(o["status"] == 200 for o in outs), outs
        assert [o["tokens"] for o in outs] == want
        assert [(r["version"], r["error"]) for r in records] == [(1, None), (2, None)]
        assert all(r["moved"] > 0 and r["load_s"] > 0 for r in records)
        eplb = httpx.get(f"{served.url}/eplb").json()
        assert [r["version"] for r in eplb["rebalances"]] == [1, 2]
        samples = scrape(f"{served.url}/metrics")
        assert samples["switchyard:eplb_rebalances_total"][
            (("model_name", name), ("outcome", "ok"))] == 2


def test_no_request_fails_while_the_experts_move_every_few_steps(
        deepseek_v3_ckpt: tuple) -> None:
    """Rounds of concurrent greedy requests while the gateway rebalances by load every
    24 steps (2 redundant copies a layer) and an operator forces placements besides:
    every request answers transformers' tokens, every rebalance succeeds, several ran."""
    path, model = deepseek_v3_ckpt
    cfg = ModelConfig.from_dir(path)
    ps = prompts(seed=36, lengths=(9, 23, 5, 17, 12, 30, 8, 14))
    want = [reference_greedy(model, p, 24) for p in ps]
    forced = [_moved(cfg.num_experts, cfg.moe_layer_ids, s, e) for s, e in
              [(1, 2), (0, 5), (1, 7)]]
    with Served(["--model", str(path), "--expert-services", "2", "--enable-eplb",
                 "--eplb-interval", "24", "--eplb-window", "24", "--num-redundant-experts",
                 "2", "--max-num-batched-tokens", "32"]) as served:
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        done = threading.Event()
        answers: list[int] = []

        def operator() -> None:
            for placement in itertools.cycle(forced):
                if done.wait(0.5):
                    return
                answers.append(httpx.post(
                    f"{served.url}/eplb/rebalance", timeout=120,
                    json={"placement": json.loads(placement.to_json())}).status_code)

        thread = threading.Thread(target=operator)
        thread.start()
        def triggers() -> set[str]:
            return {r["trigger"] for r in
                    httpx.get(f"{served.url}/eplb").json()["rebalances"]}

        try:  # 4 rounds at least, and on until the gateway moved by load (a poll a second)
            rounds, deadline = 0, time.monotonic() + 120
            while rounds < 4 or ("interval" not in triggers() and time.monotonic() < deadline):
                assert concurrent_greedy(served.url, name, ps, max_tokens=24) == want
                rounds += 1
        finally:
            done.set()
            thread.join(120)
        records = httpx.get(f"{served.url}/eplb").json()["rebalances"]
    assert answers and set(answers) == {200}
    assert [r["error"] for r in records] == [None] * len(records)
    assert {r["trigger"] for r in records} == {"interval", "request"}
    assert [r["version"] for r in records] == list(range(1, len(records) + 1))


def test_an_expert_service_restarted_after_a_rebalance_is_given_the_new_share(
        deepseek_v3_ckpt: tuple) -> None:
    """After a move to placement version 1 (every expert on both services), expert rank
    1 is killed: its experts' rows go to rank 0's copies; `serve` starts it again, with
    the share it was started with (version 0), and the probe that finds it has it load
    version 1 before routing to it again. Transformers' tokens throughout."""
    import os
    import signal

    from switchyard.serve_process import child_pids
    from tests.support.tools import wait_until

    path, model = deepseek_v3_ckpt
    cfg = ModelConfig.from_dir(path)
    ps = prompts(seed=37, lengths=(9, 14, 21))
    want = [reference_greedy(model, p, 8) for p in ps]
    both = Placement(2, cfg.num_experts, dict.fromkeys(cfg.moe_layer_ids,
                                                       ((0, 1),) * cfg.num_experts))
    with Served(["--model", str(path), "--expert-services", "2", "--enable-eplb",
                 "--eplb-interval", "0"]) as served:
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]
        r = httpx.post(f"{served.url}/eplb/rebalance", timeout=60,
                       json={"placement": json.loads(both.to_json())})
        assert r.status_code == 200 and r.json()["rebalance"]["error"] is None, r.text

        os.kill(served.services()["expert rank 1"], signal.SIGKILL)
        assert concurrent_greedy(served.url, name, ps, 8) == want  # on rank 0's copies

        def back() -> bool:
            lines = httpx.get(f"{served.url}/health", timeout=30).json()["attention"][0][
                "experts"]
            return len(child_pids(served.proc.pid)) == len(served.children) and all(
                line.endswith(", connected") for line in lines)

        wait_until(back, 120, lambda: f"expert rank 1 back: {served.stderr()[-2000:]}")
        assert "does not hold placement version 1 (restarted?): loading it" in \
            served.stderr()
        lines = httpx.get(f"{served.url}/health").json()["attention"][0]["experts"]
        held = f": {cfg.num_experts * len(cfg.moe_layer_ids)} experts over "  # all, each
        assert all(held in line for line in lines), lines
        assert concurrent_greedy(served.url, name, ps, 8) == want
        assert httpx.get(f"{served.url}/stats").json()["placement_version"] == 1
