"""/dashboard in a real headless Chromium, against running servers under load: it loads
with no network but loopback, draws a cell for every (MoE layer, expert), its numbers
agree with /metrics, each service shows by role and place with its busy share, each
expert rank's load and balancedness show, it follows new load, and the last expert
rebalance shows. The window switch changes the figures, a hot expert shows in the
window it was hot in, a killed service shows down and then up with the events on the
time axis, and every link to a trace opens a trace the OTLP receiver holds.
SWITCHYARD_DASHBOARD_SCREENSHOTS=DIR saves what they showed (docs/dashboard-*.png)."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import product
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from selenium.webdriver.support.ui import Select, WebDriverWait

from services.model.config import ModelConfig
from switchyard.serve_process import Served
from tests.support.engines import prompts
from tests.support.metrics_text import buckets, per_expert, scrape
from tests.support.tools import chromium, phoenix, wait_until

pytestmark = pytest.mark.timeout(300)
TOKENS = "switchyard:expert_tokens_total"
COMPUTE = "switchyard:expert_compute_seconds"
CELLS = "return [...document.querySelectorAll('#heatmap td.cell')].map(td => ({...td.dataset}))"
TABLES = """return ['slowest', 'services', 'ranks'].map(id =>
    [...document.getElementById(id).tBodies[0].rows].map(tr =>
        [...tr.cells].map(td => td.textContent)))"""


def generate(url: str, seed: int, lengths: tuple[int, ...], repeat: bool = False,
             tokens: int = 6) -> None:
    """Random prompts of `lengths`, `tokens` each; with `repeat`, one more that repeats
    itself (greedy, where n-gram drafts find matches)."""
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    bodies = [{"prompt": p} for p in prompts(seed=seed, lengths=lengths)]
    bodies += [{"prompt": [5, 6, 7, 8] * 4, "temperature": 0}] if repeat else []
    for body in bodies:
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": name, "max_tokens": tokens, "ignore_eos": True, **body})
        assert r.status_code == 200, r.text


def served_name(served: Served) -> str:
    return httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]


def bucket_range(counts: dict[float, float], q: float) -> tuple[float, float]:
    """The (lower, upper) bounds of the bucket holding the q-quantile; a quantile in the
    +Inf bucket is reported as the largest finite bound, as Prometheus does."""
    bounds = sorted(counts)
    rank = q * counts[float("inf")]
    i = next(i for i, b in enumerate(bounds) if counts[b] >= rank)
    if i == len(bounds) - 1:
        return bounds[-2], bounds[-2]
    return (bounds[i - 1] if i else 0.0), bounds[i]


def screenshot(browser: object, name: str) -> None:
    """Save the page as DIR/dashboard-NAME.png where SWITCHYARD_DASHBOARD_SCREENSHOTS=DIR."""
    if folder := os.environ.get("SWITCHYARD_DASHBOARD_SCREENSHOTS"):
        browser.set_window_size(1400, 1500)  # type: ignore[attr-defined]
        browser.save_screenshot(f"{folder}/dashboard-{name}.png")  # type: ignore[attr-defined]


NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": null}'


def test_dashboard_in_chromium(qwen3_ckpt: tuple) -> None:
    path, _ = qwen3_ckpt
    cfg = ModelConfig.from_dir(path)
    moe_layers = cfg.moe_layer_ids
    with Served(["--model", str(path), "--expert-services", "2", "--enable-eplb",
                 "--eplb-interval", "0", "--speculative-config", NGRAM,
                 "--dashboard-interval", "0.5"]) as served, \
            chromium() as browser:
        generate(served.url, seed=81, lengths=(9, 14, 6, 11), repeat=True)
        samples = scrape(f"{served.url}/metrics")
        tokens = per_expert(samples, TOKENS)
        browser.get(f"{served.url}/dashboard?window=900&refresh=0.5")
        # (once the recorder's latest reading has the load)
        WebDriverWait(browser, 30).until(lambda b: (shown := page_tokens(b)) and shown == {
            k: tokens.get(k, 0.0) for k in shown})

        for bad in ("0", "abc", "901", "inf"):  # a window the server cannot keep is refused
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
        # every service by role and place, up, with its address and uptime
        assert [row[:2] for row in states] == [
            ["gateway", "up"], ["attention group 0", "up"], ["expert rank 0", "up"],
            ["expert rank 1", "up"]]
        assert states[0][2] == urlsplit(served.url).netloc
        assert all(re.fullmatch(r"\d+ (s|min \d+ s)", row[4]) for row in states), states
        # each service's busy share of its last 10 s, by compute thread
        assert states[0][3] == "" and re.fullmatch(r"attention \d+%", states[1][3])
        assert all(re.fullmatch(r"expert \d+%", row[3]) for row in states[2:]), states
        shares = [s["busy"] for s in httpx.get(f"{served.url}/dashboard/data").json()["services"]]
        assert [list(b) for b in shares] == [[], ["attention"], ["expert"], ["expert"]]
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
        WebDriverWait(browser, 30).until(lambda b: b.find_elements(
            "css selector", "#chart-throughput line.event[data-kind=rebalance]"))
        screenshot(browser, "rebalance")

        # The slowest expert's own page: its histogram as /metrics counts it since start,
        # and the ranks the rebalance placed it on.
        browser.get(browser.execute_script(  # (the link's own href: the table redraws)
            "return document.querySelector('#slowest tbody tr a').href"))
        WebDriverWait(browser, 30).until(
            lambda b: b.execute_script("return document.body.dataset.renders"))
        query = dict(p.split("=") for p in urlsplit(browser.current_url).query.split("&"))
        choose_window(browser, "all")
        samples = scrape(f"{served.url}/metrics")
        counts = buckets(samples, COMPUTE, layer=query["layer"], expert=query["expert"])
        bounds = sorted(counts)
        want = [counts[b] - (counts[bounds[i - 1]] if i else 0) for i, b in enumerate(bounds)]
        bars = "return [...document.querySelectorAll('#histogram rect.bucket')].map(" \
               "r => Number(r.dataset.count))"
        WebDriverWait(browser, 30).until(lambda b: b.execute_script(bars) == want)
        placement = httpx.get(f"{served.url}/eplb").json()["placement"]
        held = placement["layers"][query["layer"]][int(query["expert"])]
        assert json.loads(browser.find_element("id", "ranks").get_attribute(
            "data-placement")) == held
        screenshot(browser, "expert")


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


def page_tokens(browser: object) -> dict[tuple[int, int], float]:
    """The heatmap's tokens per (layer, expert), as the page shows them now."""
    cells = browser.execute_script(CELLS)  # type: ignore[attr-defined]
    return {(int(c["layer"]), int(c["expert"])): float(c["tokens"]) for c in cells}


def choose_window(browser: object, value: str) -> None:
    Select(browser.find_element("id", "window-select")).select_by_value(value)  # type: ignore[attr-defined]


def increase(after: dict, before: dict) -> dict[tuple[int, int], float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def test_windows_and_a_hot_expert_in_chromium(qwen3_ckpt: tuple) -> None:
    """Even load, then (once it is out of a 10 s window) a skewed one: the 10 s window
    shows exactly the skewed load's tokens per expert, its hottest expert above its share
    of the even load, and "since start" both loads."""
    path, _ = qwen3_ckpt
    metrics = None
    with Served(["--model", str(path), "--expert-services", "2",
                 "--dashboard-interval", "0.25"]) as served, chromium() as browser:
        metrics = f"{served.url}/metrics"
        start = per_expert(scrape(metrics), TOKENS)  # (the warm-up's)
        generate(served.url, seed=83, lengths=(9, 14, 6, 11, 7, 12))  # even
        even = increase(per_expert(scrape(metrics), TOKENS), start)
        browser.get(f"{served.url}/dashboard?window=10&refresh=0.5")
        WebDriverWait(browser, 30).until(lambda b: sum(page_tokens(b).values()) == 0)
        screenshot(browser, "steady")
        choose_window(browser, "all")  # since start: everything
        WebDriverWait(browser, 30).until(
            lambda b: page_tokens(b) == {k: even.get(k, 0.0) + v for k, v in start.items()}
            | {k: v for k, v in even.items() if k not in start})
        assert browser.find_element("id", "window").text == "since the services started"
        choose_window(browser, "10")
        WebDriverWait(browser, 30).until(lambda b: sum(page_tokens(b).values()) == 0)

        before = per_expert(scrape(metrics), TOKENS)
        generate(served.url, seed=0, lengths=(), repeat=True)  # one token over and over
        generate(served.url, seed=0, lengths=(), repeat=True)
        skewed = increase(per_expert(scrape(metrics), TOKENS), before)

        def skewed_shown(b: object) -> dict | None:
            tokens = page_tokens(b)
            return tokens if tokens == {k: skewed.get(k, 0.0) for k in tokens} else None

        shown = WebDriverWait(browser, 10).until(skewed_shown)
        hot = max(shown, key=shown.__getitem__)
        layer_share = lambda load, key: load.get(key, 0.0) / sum(  # noqa: E731
            v for k, v in load.items() if k[0] == key[0])
        assert layer_share(skewed, hot) > 1.5 * layer_share(even, hot), (hot, skewed, even)
        cell = browser.find_element("id", f"cell-{hot[0]}-{hot[1]}")
        Select(browser.find_element("id", "metric")).select_by_value("tokens")
        assert cell.value_of_css_property("background-color") == \
            "rgba(184, 10, 10, 1)"  # the darkest, colour(1): hsl(0, 90%, 38%)
        screenshot(browser, "hot-expert")
        # Since start, the even load dilutes it: the window before the skew shows in it.
        choose_window(browser, "all")
        everything = WebDriverWait(browser, 10).until(
            lambda b: (t := page_tokens(b)) and t[hot] == start.get(hot, 0.0) + even.get(
                hot, 0.0) + skewed[hot] and t)
        assert layer_share(everything, hot) < layer_share(shown, hot)


EVENTS = """return [...document.querySelectorAll('#chart-throughput line.event')].map(
    e => [e.dataset.kind, Number(e.dataset.t), e.textContent])"""


def service_state(browser: object, name: str) -> str | None:
    rows = browser.execute_script(TABLES)[1]  # type: ignore[attr-defined]
    return next((row[1] for row in rows if row[0] == name), None)


def attention_group(served: Served, index: int) -> int:
    """The process id of attention group `index` (its --attention-rank)."""
    for name, pid in served.services().items():
        args = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        if name.startswith("attention group") and \
                args[args.index("--attention-rank") + 1] == str(index):
            return pid
    raise LookupError(f"no attention group {index}")


def test_a_killed_service_shows_down_then_up_with_the_events_on_the_time_axis(
        qwen3_ckpt: tuple) -> None:
    """Under load, SIGKILL expert rank 1 and then an attention group: each shows as down
    and then up again; the deaths, the returns and the requests failed over to the other
    group are marked on the time axis, when they happened."""
    path, _ = qwen3_ckpt
    with Served(["--model", str(path), "--expert-services", "2", "--attention-groups", "2",
                 "--routing-policy", "least-busy", "--dashboard-interval", "0.25"]) as served, \
            chromium() as browser, ThreadPoolExecutor(2) as pool:
        stop = threading.Event()

        def load(seed: int) -> None:
            while not stop.is_set():
                generate(served.url, seed=seed, lengths=(9,), tokens=48)

        running = [pool.submit(load, seed) for seed in (84, 85)]
        browser.get(f"{served.url}/dashboard?window=300&refresh=0.5")
        WebDriverWait(browser, 30).until(lambda b: service_state(b, "expert rank 1") == "up")
        try:
            for name, pid in (("expert rank 1", served.service("expert rank 1")),
                              ("attention group 1", attention_group(served, 1))):
                killed = time.time()
                os.kill(pid, signal.SIGKILL)
                WebDriverWait(browser, 60, poll_frequency=0.1).until(
                    lambda b, name=name: service_state(b, name) == "down")
                WebDriverWait(browser, 120).until(
                    lambda b, name=name: service_state(b, name) == "up")
                back = time.time()
                marks = browser.execute_script(EVENTS)
                assert any(k == "down" and killed - 1 <= t <= back and name in text
                           for k, t, text in marks), (name, marks)
                assert any(k == "up" and killed <= t <= back + 1 and name in text
                           for k, t, text in marks), (name, marks)
            WebDriverWait(browser, 60).until(lambda b: any(
                k == "failover" for k, _, _ in b.execute_script(EVENTS)))
            screenshot(browser, "failover")
        finally:
            stop.set()
        for future in running:
            future.result(timeout=120)  # no request lost
        events = [row[1] for row in browser.execute_script(
            "return [...document.querySelectorAll('#events tr')].map(tr => "
            "[...tr.cells].map(td => td.textContent))")[1:]]
        assert {"down", "up", "failover"} <= set(events)


def test_every_link_to_a_trace_opens_a_trace_the_receiver_holds(qwen3_ckpt: tuple) -> None:
    """Traced to Arize Phoenix with `--otlp-ui-url` at Phoenix's trace links: each of the
    slowest requests links to its trace, which Phoenix holds (its REST API), and the link
    opens Phoenix's page of that trace in the browser."""
    path, _ = qwen3_ckpt
    with phoenix() as receiver:
        ui = f"{receiver.base}/redirects/traces/{{trace_id}}"
        with Served(["--model", str(path), "--expert-services", "2", "--otlp-traces-endpoint",
                     receiver.traces_url, "--otlp-ui-url", ui, "--dashboard-interval", "0.5"],
                    env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as served, chromium() as browser:
            generate(served.url, seed=86, lengths=(9, 14, 6, 11, 7))
            browser.get(f"{served.url}/dashboard?window=300&refresh=1")
            links = WebDriverWait(browser, 30).until(lambda b: len(
                found := [a.get_attribute("href") for a in b.find_elements(
                    "css selector", "#requests a")]) == 5 and found)
            ids = [link.rpartition("/")[2] for link in links]
            assert all(link == ui.replace("{trace_id}", i) for link, i in zip(
                links, ids, strict=True)) and len(set(ids)) == 5

            def held() -> bool:
                names = {(s["context"]["trace_id"], s["name"]) for s in receiver.spans()}
                return all((i, f"text_completion {served_name(served)}") in names
                           for i in ids)

            wait_until(held, 60, lambda: f"the traces {ids} in Phoenix")
            for link, trace_id in zip(links, ids, strict=True):
                browser.get(link)
                WebDriverWait(browser, 60).until(
                    lambda b, t=trace_id: t in b.current_url and
                    "text_completion" in b.find_element("tag name", "body").text)
            screenshot(browser, "trace")  # (Phoenix's page of the last one)
