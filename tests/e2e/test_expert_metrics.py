"""Per-expert Prometheus series: each service's own /metrics, merged on the gateway's, and
moving with the load exactly as the router sent it (the engine's own routing counts)."""

from __future__ import annotations

import httpx
import pytest

from switchyard.serve_process import Served
from tests.support.engines import prompts
from tests.support.metrics_text import per_expert, scrape

pytestmark = pytest.mark.timeout(300)
TOKENS = "switchyard:expert_tokens_total"
CALLS = "switchyard:expert_compute_seconds_count"


def routed(url: str) -> dict[tuple[int, int], float]:
    """The engine's count of routed token copies per (layer, expert), from /stats."""
    load = httpx.get(f"{url}/stats", timeout=30).json()["expert_load"]
    return {(layer, e): n for layer, row in enumerate(load) for e, n in enumerate(row) if n}


def generate(url: str, seed: int, n: int) -> None:
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    for prompt in prompts(seed=seed, lengths=(7, 12, 5)[:n]):
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": name, "prompt": prompt, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("flags", [["--expert-services", "2"],
                                   ["--dispatch-backend", "local"]], ids=["rpc", "local"])
def test_per_expert_series_follow_the_load(qwen3_ckpt: tuple, flags: list[str]) -> None:
    path, _ = qwen3_ckpt
    backend = "rpc" if "--expert-services" in flags else "local"
    with Served(["--model", str(path), *flags]) as served:
        before = scrape(f"{served.url}/metrics")
        busy_before = before.get("switchyard:busy_seconds_total", {})
        warmup = per_expert(before, TOKENS)  # the warm-up alone so far: every expert ran
        assert warmup == routed(served.url)
        assert set(warmup) == set(per_expert(before, CALLS)) == {
            (layer, e) for layer in (0, 2) for e in range(8)}  # qwen3_ckpt's MoE layers
        ups = before["switchyard:service_up"]
        assert len(ups) == (3 if backend == "rpc" else 1) and set(ups.values()) == {1.0}

        generate(served.url, seed=71, n=1)
        first = scrape(f"{served.url}/metrics")
        tokens = per_expert(first, TOKENS)
        assert tokens and tokens == routed(served.url)  # as routed, summed over ranks
        assert set(per_expert(first, CALLS)) == set(tokens)  # a latency for each expert
        ranks = {dict(labels)["rank"] for labels in first[TOKENS]}
        assert ranks == ({"0", "1"} if backend == "rpc" else {"0"})
        dispatches = first["switchyard:dispatch_seconds_count"][(("backend", backend),)]
        assert dispatches > 0
        assert first["switchyard:combine_seconds_count"][(("backend", backend),)] == dispatches

        # Each service serves its own share; the gateway's is their sum.
        own = [scrape(dict(labels)["service"]) for labels in ups]
        assert [sorted({dict(k)["rank"] for k in o.get(TOKENS, {})}) for o in own] == \
            ([[], ["0"], ["1"]] if backend == "rpc" else [["0"]])  # attention, experts
        summed: dict[tuple[int, int], float] = {}
        for o in own:
            for k, v in per_expert(o, TOKENS).items():
                summed[k] = summed.get(k, 0.0) + v
        assert summed == tokens

        generate(served.url, seed=72, n=3)
        second = scrape(f"{served.url}/metrics")
        more = per_expert(second, TOKENS)
        assert more == routed(served.url)
        assert sum(more.values()) > sum(tokens.values())
        assert all(more[k] >= v for k, v in tokens.items())
        assert second["switchyard:dispatch_seconds_count"][(("backend", backend),)] > dispatches

        # Busy time: each service's compute thread; with rpc the attention service also
        # waited on its expert services' answers, and each expert service computed.
        busy = second["switchyard:busy_seconds_total"]
        waits = second["switchyard:wait_seconds_total"]
        assert busy[(("service", "attention"),)] > busy_before.get((("service", "attention"),), 0)
        if backend == "rpc":
            assert busy[(("service", "expert"),)] > 0 and waits[(("service", "attention"),)] > 0
        for o in own:
            fractions = o["switchyard:busy_fraction"]
            assert len(fractions) == 1 and 0 < next(iter(fractions.values())) <= 1
