"""/dashboard in a real headless Chromium: it loads with no network but loopback, draws a
cell for every (MoE layer, expert), its numbers agree with /metrics, each service's busy
share and each expert rank's load and balancedness show, it follows new load, and the
last expert rebalance shows.
SWITCHYARD_DASHBOARD_SCREENSHOT=PATH saves what it showed (docs/dashboard.png)."""

from __future__ import annotations

import math
import os
import re
from itertools import product
from urllib.parse import urlsplit

import httpx
import pytest
from selenium.webdriver.support.ui import WebDriverWait

from services.model.config import ModelConfig
from switchyard.serve_process import Served
from tests.support.engines import prompts
from tests.support.metrics_text import buckets, per_expert, scrape
from tests.support.tools import chromium

pytestmark = pytest.mark.timeout(300)
TOKENS = "switchyard:expert_tokens_total"
COMPUTE = "switchyard:expert_compute_seconds"
CELLS = "return [...document.querySelectorAll('#heatmap td.cell')].map(td => ({...td.dataset}))"
TABLES = """return ['slowest', 'services', 'ranks'].map(id =>
    [...document.getElementById(id).tBodies[0].rows].map(tr =>
        [...tr.cells].map(td => td.textContent)))"""


def generate(url: str, seed: int, lengths: tuple[int, ...], repeat: bool = False) -> None:
    """Random prompts of `lengths`; with `repeat`, one more that repeats itself (greedy,
    where n-gram drafts find matches)."""
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    bodies = [{"prompt": p} for p in prompts(seed=seed, lengths=lengths)]
    bodies += [{"prompt": [5, 6, 7, 8] * 4, "temperature": 0}] if repeat else []
    for body in bodies:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": name, "max_tokens": 6, "ignore_eos": True, **body})
        assert r.status_code == 200, r.text


def bucket_range(counts: dict[float, float], q: float) -> tuple[float, float]:
    """The (lower, upper) bounds of the bucket holding the q-quantile; a quantile in the
    +Inf bucket is reported as the largest finite bound, as Prometheus does."""
    bounds = sorted(counts)
    rank = q * counts[float("inf")]
    i = next(i for i, b in enumerate(bounds) if counts[b] >= rank)
    if i == len(bounds) - 1:
        return bounds[-2], bounds[-2]
    return (bounds[i - 1] if i else 0.0), bounds[i]


NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": null}'


def test_dashboard_in_chromium(qwen3_ckpt: tuple) -> None:
    path, _ = qwen3_ckpt
    cfg = ModelConfig.from_dir(path)
    moe_layers = cfg.moe_layer_ids
    with Served(["--model", str(path), "--expert-services", "2", "--enable-eplb",
                 "--eplb-interval", "0", "--speculative-config", NGRAM]) as served, \
            chromium() as browser:
        generate(served.url, seed=81, lengths=(9, 14, 6, 11), repeat=True)
        samples = scrape(f"{served.url}/metrics")
        tokens = per_expert(samples, TOKENS)
        browser.get(f"{served.url}/dashboard?window=900&refresh=0.5")
        WebDriverWait(browser, 30).until(
            lambda b: b.execute_script("return document.body.dataset.renders"))

        for bad in ("0", "abc", "901"):  # a window the server cannot keep is refused
            assert httpx.get(f"{served.url}/dashboard/data?window={bad}").status_code == 400

        # Offline: every resource came from the gateway itself.
        origin = "{0.scheme}://{0.netloc}".format(urlsplit(served.url))
        resources = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)")
        assert resources and all(r.startswith(origin) for r in resources)
        assert browser.find_element("id", "error").get_attribute("hidden") is not None

        cells = browser.execute_script(CELLS)
        keys = [(int(c["layer"]), int(c["expert"])) for c in cells]
        assert sorted(keys) == sorted(product(moe_layers, range(cfg.num_experts)))
        busy = 0
        for key, cell in zip(keys, cells, strict=True):
            assert float(cell["tokens"]) == tokens.get(key, 0.0)
            if not tokens.get(key):
                assert cell["calls"] == "0" and cell["p99S"] == ""
                continue
            busy += 1
            counts = buckets(samples, COMPUTE, layer=str(key[0]), expert=str(key[1]))
            assert float(cell["calls"]) == counts[float("inf")]
            for q, shown in ((0.5, cell["p50S"]), (0.99, cell["p99S"])):
                lower, upper = bucket_range(counts, q)
                assert lower <= float(shown) <= upper, (key, q, shown, lower, upper)
        assert busy >= len(moe_layers) * 2  # top-2 routing of 40 tokens

        # The slowest list starts with the cell of the largest p99.
        slowest, states, ranks = browser.execute_script(TABLES)  # at once: it re-renders
        layer, expert = map(int, slowest[0][:2])
        p99 = {k: float(c["p99S"]) for k, c in zip(keys, cells, strict=True) if c["p99S"]}
        assert p99[(layer, expert)] == max(p99.values())
        assert [row[1] for row in states] == ["up"] * 4  # attention, its /metrics, 2 experts
        # each service's busy share of its last 10 s, by compute thread
        assert states[0][3] == "" and re.fullmatch(r"attention \d+%", states[1][3])
        assert all(re.fullmatch(r"expert \d+%", row[3]) for row in states[2:]), states
        shares = [s["busy"] for s in httpx.get(f"{served.url}/dashboard/data").json()["services"]]
        assert [list(b) for b in shares] == [["attention"], ["expert"], ["expert"]]
        assert all(0.0 <= f <= 1.0 for b in shares for f in b.values())

        # The expert ranks' rows (every layer), and their balancedness as /metrics has it:
        # mean over max per layer, the layers' means summed over their maxima summed.
        by_rank: dict[tuple[int, int], float] = {}
        for labels, value in samples[TOKENS].items():
            d = dict(labels)
            key = (int(d["layer"]), int(d["rank"]))
            by_rank[key] = by_rank.get(key, 0.0) + value
        assert [(int(r[0]), float(r[1])) for r in ranks] == [
            (rank, sum(v for (_, r), v in by_rank.items() if r == rank)) for rank in (0, 1)]
        loads = {layer: [by_rank.get((layer, r), 0.0) for r in (0, 1)] for layer in moe_layers}
        want = sum(sum(v) / 2 for v in loads.values()) / sum(max(v) for v in loads.values())
        shown = browser.find_element("id", "balancedness").text
        assert shown == f"· balancedness {want:.2f}", shown
        gauge = scrape(f"{served.url}/metrics")["switchyard:expert_balancedness"]
        assert abs(gauge[(("layer", "all"), ("model_name", dict(next(iter(gauge)))[
            "model_name"]))] - want) < 1e-9
        assert {dict(k)["layer"] for k in gauge} == {"all", *map(str, moe_layers)}

        assert browser.find_element("id", "rebalance").text == \
            "expert rebalancing: on, none yet"

        # Speculation's acceptance, as /metrics counts it (n-gram drafts of up to 3).
        spec = {name: sum(samples[f"switchyard:spec_decode_num_{name}_total"].values())
                for name in ("drafts", "draft_tokens", "accepted_tokens")}
        assert spec["drafts"] > 0
        percent = math.floor(100 * spec["accepted_tokens"] / spec["draft_tokens"] + 0.5)
        assert browser.find_element("id", "speculation").text == (  # (JS's Math.round)
            f"acceptance {percent}% of "
            f"{spec['draft_tokens']:g} draft tokens; mean accepted length "
            f"{1 + spec['accepted_tokens'] / spec['drafts']:.2f} tokens a verify step "
            f"({spec['drafts']:g} drafts)")

        # Live: more load shows up without reloading the page.
        generate(served.url, seed=82, lengths=(13,))
        total = sum(per_expert(scrape(f"{served.url}/metrics"), TOKENS).values())
        assert total > sum(tokens.values())
        WebDriverWait(browser, 30).until(lambda b: sum(
            float(c["tokens"]) for c in b.execute_script(CELLS)) == total)

        # A rebalance (to EPLB's placement of the load so far) shows when and how long.
        r = httpx.post(f"{served.url}/eplb/rebalance", timeout=60)
        assert r.status_code == 200, r.text
        record = r.json()["rebalance"]
        assert record["version"] == 1 and record["error"] is None
        shown = WebDriverWait(browser, 30).until(lambda b: re.fullmatch(
            r"last rebalance: .+, ([\d.]+) s \(load ([\d.]+) s\), placement version 1, "
            r"(\d+) copies moved", b.find_element("id", "rebalance").text))
        assert [float(shown[1]), float(shown[2]), int(shown[3])] == [
            round(record["duration_s"], 2), round(record["load_s"], 2), record["moved"]]
        if shot := os.environ.get("SWITCHYARD_DASHBOARD_SCREENSHOT"):
            browser.save_screenshot(shot)


def test_dashboard_asks_for_the_admin_key_in_chromium() -> None:
    """With --admin-api-key the page (open) asks for the key its data needs, keeps it for
    the tab and draws once given it; the key never shows in the page."""
    key = "sk-admin-dashboard-5e1"
    with Served(["--admin-api-key", key, "--dispatch-backend", "local"]) as served, \
            chromium() as browser:
        browser.get(f"{served.url}/dashboard?refresh=0.3")
        WebDriverWait(browser, 30).until(
            lambda b: b.find_element("id", "key-form").get_attribute("hidden") is None)
        assert "admin API key" in browser.find_element("id", "error").text
        assert not browser.execute_script("return document.body.dataset.renders")
        browser.find_element("id", "admin-key").send_keys(key)
        browser.find_element("css selector", "#key-form button").click()
        WebDriverWait(browser, 30).until(
            lambda b: b.execute_script("return document.body.dataset.renders"))
        assert browser.find_element("id", "key-form").get_attribute("hidden") is not None
        assert browser.find_element("id", "error").get_attribute("hidden") is not None
        assert key not in browser.page_source
