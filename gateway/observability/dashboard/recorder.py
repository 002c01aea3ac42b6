"""The dashboard's memory. Every `--dashboard-interval` seconds the recorder reads every
service's `/metrics` and the gateway's own series, adds what they counted into the
window's totals (`windows.Window`), and keeps a point of each chart's values (`charts`),
each service's state, and what happened: rebalances, a service down, up again or
restarted, requests failed over to another attention group. It keeps `history_s`
seconds of all of it, so its memory is bounded whatever the load.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import anyio
from prometheus_client.metrics_core import Metric

from common.messages import EngineStats
from gateway.errors import GatewayError
from gateway.observability.dashboard.windows import EMPTY, STAGES, Hist, Key, Window, total
from gateway.observability.metrics import Metrics, balance
from gateway.observability.request_log import RequestLog
from gateway.observability.service_metrics import Scrape, ServiceMetrics
from gateway.routing.engine_pool import EnginePool
from gateway.routing.rebalancer import Rebalancer

log = logging.getLogger(__name__)
BUSY = "switchyard:busy_fraction"
STARTED = "switchyard:service_start_time_seconds"
EVENTS_KEPT = 1000
MAX_SHARE = 10  # ticks are at least this many times their CPU time apart
ROLES = ("gateway", "attention", "expert", "")  # the order the services are listed in
HISTORY_S = 900.0  # what the dashboard keeps: its longest window


@dataclass(frozen=True)
class Settings:
    """The dashboard's part of the gateway's configuration."""

    model: str  # the served model's name
    address: str  # the gateway's own URL
    interval_s: float = 5.0  # between readings
    window_s: float = 60.0  # the window the page shows first
    trace_url: str | None = None  # a trace's page in the tracing UI, with {trace_id}


@dataclass(frozen=True)
class Sources:
    """What the dashboard reads: the attention groups, the gateway's own series, the
    services' /metrics, the rebalancer's records and the finished requests."""

    engine: EnginePool
    metrics: Metrics
    services: ServiceMetrics
    rebalancer: Rebalancer
    requests: RequestLog


@dataclass(frozen=True)
class Event:
    """Something that happened, at `t` (Unix seconds): kind is one of "rebalance",
    "down", "up", "restart" and "failover"."""

    t: float
    kind: str
    text: str


@dataclass(frozen=True)
class Service:
    """A service as last read: its name (by role and place, or its URL where it did not
    say), address, whether it answered (and why not), its busy share per compute thread
    and when it started (Unix seconds)."""

    name: str
    role: str
    index: int
    member: int
    url: str
    up: bool
    detail: str = ""
    busy: dict[str, float] = field(default_factory=dict)
    started: float | None = None

    @property
    def order(self) -> tuple[int, int, int, str]:
        return ROLES.index(self.role), self.index, self.member, self.url


def identity(url: str, families: list[Metric]) -> tuple[str, str, int, int, float | None]:
    """(name, role, index, member, start time) from a service's `switchyard:service_
    start_time_seconds`; the URL as its name where it has none."""
    for family in families:
        if family.name == STARTED and family.samples:
            sample = family.samples[0]
            role, index = sample.labels["role"], int(sample.labels["index"])
            member = int(sample.labels["member"])
            name = f"attention group {index}" + (f" (DCP rank {member})" if member else "") \
                if role == "attention" else f"{role} rank {index}"
            return name, role, index, member, sample.value
    return url, "", 0, 0, None


def busy(families: list[Metric]) -> dict[str, float]:
    """A service's busy share of its last seconds, per compute thread (`service` label:
    attention, expert): both sides of a ping-pong pipeline busy at once is what
    disaggregation is for."""
    return {sample.labels.get("service", ""): sample.value for family in families
            if family.name == BUSY for sample in family.samples}


def point_values(added: dict[Key, Hist], seconds: float) -> dict[str, float | None]:
    """The charts' values over one tick (`charts.CHARTS`' keys), from what it added."""
    def hist(*key: str) -> Hist:
        return added.get(key, EMPTY)

    load = balance({(int(k[1]), int(k[2])): h.tokens for k, h in added.items()
                    if k[0] == "rank"})
    rows = sum(r["tokens"] for r in load["ranks"])  # type: ignore[attr-defined]
    stage = {name: total([h for k, h in added.items() if k[0] == name]) for name in STAGES}
    return {
        "output_tokens_per_s": hist("counter", "output_tokens").tokens / seconds,
        "ttft_p50_s": hist("request", "ttft").quantile(0.5),
        "ttft_p99_s": hist("request", "ttft").quantile(0.99),
        "tpot_p50_s": hist("request", "tpot").quantile(0.5),
        "tpot_p99_s": hist("request", "tpot").quantile(0.99),
        "balancedness": load["balancedness"],  # type: ignore[dict-item]
        **{f"rank_share:{r['rank']}": r["tokens"] / rows if rows else None  # type: ignore[index]
           for r in load["ranks"]},  # type: ignore[attr-defined]
        "dispatch_p99_s": stage["dispatch"].quantile(0.99),
        "combine_p99_s": stage["combine"].quantile(0.99),
    }


class Recorder:
    """Reads every service each tick and keeps the last `history_s` seconds."""

    def __init__(self, settings: Settings, sources: Sources,
                 history_s: float = HISTORY_S) -> None:
        self.settings, self.sources = settings, sources
        self.interval_s = settings.interval_s
        self.history_s = history_s
        self.window = Window(history_s)
        self.points: deque[dict[str, float | None]] = deque()  # each with "t" (Unix s)
        self.events: deque[Event] = deque(maxlen=EVENTS_KEPT)
        self.services: list[Service] = []
        self.started = time.time()
        self.ticks = 0  # readings so far: what an answer computed from them is valid for
        self.lock = anyio.Lock()  # a tick and a view: one at a time
        self._last_scrapes: dict[str, Service] = {}
        self._rebalances_seen = 0.0  # the last rebalance's start already an event
        self._resubmitted = 0

    async def run(self) -> None:
        """Tick every `interval_s`, or less often where a tick costs the gateway more CPU
        time than a tenth of that (a large model's expert ranks write a quarter of a
        million series): the readings never take more than a tenth of a core. (CPU time,
        not wall time: a machine busy with other processes slows a tick without making
        it cost more.)"""
        while True:
            start, cpu = time.monotonic(), time.process_time()
            try:
                await self.tick()
            except Exception:  # the next tick tries again; the page shows the last one's
                log.exception("dashboard: a reading failed")
            cost = time.process_time() - cpu
            await anyio.sleep(max(0.0, max(self.interval_s, MAX_SHARE * cost)
                                  - (time.monotonic() - start)))

    async def tick(self) -> None:
        """Read every service and the engine's state; keep a point."""
        sources = self.sources
        scrapes = await sources.services.scrape()
        stats = None
        if sources.engine.all_connected:  # (a group restarting: no gauges this tick)
            with contextlib.suppress(GatewayError):
                stats = await sources.engine.stats(timeout=self.interval_s + 1)
        own = Scrape("gateway", list(sources.metrics.registry.collect()))
        async with self.lock:  # (the views read all of it in a worker thread)
            await anyio.to_thread.run_sync(self._absorb, [*scrapes, own], stats)

    def _absorb(self, scrapes: list[Scrape], stats: EngineStats | None) -> None:
        self.window.absorb(scrapes, time.monotonic())
        added, seconds = self.window.last_tick()
        point: dict[str, float | None] = {"t": time.time()}
        if seconds > 0:
            point |= point_values(added, seconds)
        if stats is not None:
            point |= {"running": stats.num_running, "waiting": stats.num_waiting,
                      "kv_usage": stats.kv_blocks_used / max(stats.num_kv_blocks, 1)}
        self.points.append(point)
        while self.points[0]["t"] < point["t"] - self.history_s:  # type: ignore[operator]
            self.points.popleft()
        self._note_services(scrapes[:-1])  # (not the gateway's own)
        self._note_rebalances()
        if (resubmitted := self.sources.engine.resubmitted) > self._resubmitted:
            self.events.append(Event(time.time(), "failover", f"{resubmitted - self._resubmitted}"
                                     " requests resubmitted after losing their attention group"))
            self._resubmitted = resubmitted
        self.ticks += 1

    def _note_services(self, scrapes: list[Scrape]) -> None:
        """Each service's state now, and an event where one went down, came back or
        restarted since the last tick."""
        now = time.time()
        services = [Service("gateway", "gateway", 0, 0, self.settings.address, True,
                            started=self.started)]
        for scrape in scrapes:
            before = self._last_scrapes.get(scrape.url)
            if scrape.up:
                name, role, index, member, started = identity(scrape.url, scrape.families)
                service = Service(name, role, index, member, scrape.url, True,
                                  busy=busy(scrape.families), started=started)
            elif before is not None:
                service = Service(before.name, before.role, before.index, before.member,
                                  scrape.url, False, scrape.error or "", started=before.started)
            else:
                service = Service(scrape.url, "", 0, 0, scrape.url, False, scrape.error or "")
            if before is not None and before.up and not service.up:
                self.events.append(Event(now, "down", f"{service.name} down: {service.detail}"))
            elif before is not None and not before.up and service.up:
                self.events.append(Event(now, "up", f"{service.name} up again"))
            elif before is not None and service.started != before.started and service.up:
                self.events.append(Event(now, "restart", f"{service.name} restarted"))
            self._last_scrapes[scrape.url] = service
            services.append(service)
        self.services = sorted(services, key=lambda s: s.order)

    def _note_rebalances(self) -> None:
        for record in self.sources.rebalancer.history:
            if record.started > self._rebalances_seen:
                self._rebalances_seen = record.started
                text = (f"rebalance failed: {record.error}" if record.error else
                        f"rebalance to placement version {record.version}: {record.moved} "
                        f"copies moved in {record.duration_s:.2f} s")
                self.events.append(Event(record.started, "rebalance", text))
