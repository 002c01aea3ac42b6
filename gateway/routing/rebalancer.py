"""Expert load balancing (EPLB) while serving, turned on by `--enable-eplb`.

The gateway rebalances every `--eplb-interval` engine steps. Steps are summed over the
attention groups, which are the source of truth for routing. The gateway takes the routing
load of the last `--eplb-window` steps, per MoE layer and expert, from each group's
counters. It makes DeepSeek's EPLB placement of that load, with `--num-redundant-experts`
extra copies. An attention group computes the placement with `ep_dispatch.eplb`, because
the gateway has no torch. The gateway then sends the placement to every group as the next
placement version.

Each group has its expert ranks load their new shares while serving, then routes by the
new placement from one step to the next. The ranks free the old shares once no group uses
them. `POST /eplb/rebalance` asks for a rebalance now, for example from an operator or a
test, optionally with the placement to move to.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from common import tracing
from common.messages import EngineStats, PlanPlacement, Rebalance, Rebalanced
from gateway.routing.engine_pool import EnginePool

log = logging.getLogger(__name__)
HISTORY = 32  # rebalances remembered for /eplb and the dashboard
KEEP = 64  # readings kept across a window, so its start is known to 1/64 of it


@dataclass(frozen=True)
class EplbConfig:
    """Settings for expert load balancing.

    - interval: engine steps between rebalances. 0 means only when asked.
    - window: the steps of routing load that a placement is made from.
    - num_redundant: extra expert copies. The placement holds experts + num_redundant
      copies per layer, spread evenly over the ranks.
    - num_groups, num_nodes: EPLB's hierarchy. num_groups None means the model's expert
      groups, n_group.
    - poll_s: how often the groups' counters are read.
    - timeout_s: the time limit for one rebalance.
    """

    enabled: bool = False
    interval: int = 3000
    window: int = 1000
    num_redundant: int = 0
    num_groups: int | None = None
    num_nodes: int = 1
    poll_s: float = 1.0
    timeout_s: float = 600.0


@dataclass(frozen=True)
class RebalanceRecord:
    """One rebalance.

    It records when the rebalance started, in Unix seconds, and how long it took in all.
    It records the slowest expert rank's load time, the slowest group's switch time, and
    the number of expert copies that moved. A copy moved if it is on a rank that did not
    hold it before. It also records what asked for the rebalance, and its error if it
    failed.
    """

    version: int
    started: float
    duration_s: float
    load_s: float
    switch_s: float
    moved: int
    trigger: str
    error: str | None = None


class Rebalancer:
    def __init__(self, pool: EnginePool, config: EplbConfig,
                 on_record: Callable[[RebalanceRecord], None] = lambda _: None) -> None:
        self.pool, self.config, self._on_record = pool, config, on_record
        self.history: deque[RebalanceRecord] = deque(maxlen=HISTORY)
        # The placement routed by now, as known from a group. It is a placement's JSON as
        # `Placement.to_json` writes it:
        # {"num_ranks": N, "layers": {"3": [[ranks of expert 0], ...], ...}}
        self.placement: dict[str, Any] | None = None
        self._latest: tuple[int, list[list[int]]] | None = None  # last (steps, load) read
        self._kept: deque[tuple[int, list[list[int]]]] = deque()  # readings for the window
        self._last_steps: int | None = None  # steps at start, or at the last rebalance
        self._moving = anyio.Lock()  # one rebalance at a time

    async def run(self) -> None:
        """Read the groups' counters every `poll_s`, and rebalance every `interval` steps."""
        while True:
            await anyio.sleep(self.config.poll_s)
            try:
                stats = await self.pool.group_stats()
            except Exception as exc:  # a group is down; its counters return with it
                log.debug("eplb: no stats (%s)", exc)
                continue
            steps = self._observe(stats)
            if self._last_steps is None:
                self._last_steps = steps
            if self.config.interval and steps - self._last_steps >= self.config.interval:
                self._last_steps = steps  # also after a rebalance asked for meanwhile
                try:
                    await self.rebalance(trigger="interval")
                except Exception as exc:  # no load yet, or a group gone; retried next interval
                    log.warning("eplb: no rebalance: %s", exc)

    def _observe(self, stats: list[EngineStats]) -> int:
        """Take in the groups' counters and return the steps.

        Steps and load are summed over the groups. Readings are kept at least 1/KEEP of the
        window apart, and only back to the newest one at or before the window's start. So
        at most KEEP + 1 readings are kept.
        """
        steps = sum(s.num_steps for s in stats)
        load = [[sum(col) for col in zip(*rows, strict=True)]
                for rows in zip(*(s.expert_load for s in stats), strict=True)]
        if self._latest is not None and steps < self._latest[0]:
            self._kept.clear()  # a group restarted, so its counters began again
        self._latest = (steps, load)
        if not self._kept or steps - self._kept[-1][0] >= max(1, self.config.window // KEEP):
            self._kept.append((steps, load))
        while len(self._kept) > 1 and self._kept[1][0] <= steps - self.config.window:
            self._kept.popleft()
        return steps

    def window_load(self, moe_layers: list[int]) -> list[list[int]]:
        """[L_moe][E] routed token copies per MoE layer and expert.

        They cover at least the last `window` steps. Where fewer steps were seen, this is
        everything counted so far.
        """
        if self._latest is None:
            raise ValueError("no routing load was read yet")
        steps, now = self._latest
        base_steps, base = self._kept[0]
        if base_steps > steps - self.config.window:
            base = [[0] * len(row) for row in now]
        return [[a - b for a, b in zip(now[i], base[i], strict=True)] for i in moe_layers]

    async def plan(self, num_ranks: int, moe_layers: list[int], routing_groups: int
                   ) -> dict[str, Any]:
        """EPLB's placement of the window's load, made by a connected group."""
        load = self.window_load(moe_layers)
        if not any(map(any, load)):
            raise ValueError("no tokens were routed in the window")
        group = next((c for c in self.pool.clients if c.info is not None), None)
        if group is None:
            raise ValueError("no attention service is connected")
        plan = await group.plan(PlanPlacement(
            load, moe_layers, num_ranks, self.config.num_redundant,
            self.config.num_groups or routing_groups, self.config.num_nodes),
            self.config.timeout_s)
        if plan.placement is None:
            raise ValueError(f"EPLB cannot place this load: {plan.error}")
        return json.loads(plan.placement)

    async def rebalance(self, placement: dict[str, Any] | None = None,
                        trigger: str = "request") -> RebalanceRecord | None:
        """Move every group's experts to `placement`, and return the rebalance's record.

        `placement` is a placement's JSON. With None, EPLB places the window's load.
        Returns None where that placement is already the one routed by. Raises ValueError
        where nothing can move: there are no groups, the backend cannot move experts, or
        there is no load yet. A group's failure is in the record. Examples are a placement
        that does not fit the model, or an expert rank that could not load it.
        """
        async with self._moving:
            info = self.pool.info
            if info is None:
                raise ValueError("no attention service is connected")
            if info.dispatch_backend != "rpc":
                raise ValueError("moving experts while serving needs the rpc dispatch "
                                 f"backend, not {info.dispatch_backend}")
            stats = await self.pool.group_stats()
            self._observe(stats)
            num_ranks = len(info.expert_services)
            if self.placement is None and info.placement:
                self.placement = json.loads(info.placement)
            if placement is None:
                placement = await self.plan(num_ranks, info.moe_layers, info.expert_groups)
            if placement == self.placement:
                log.info("eplb: the load's placement is the one routed by already")
                return None
            version = max(s.placement_version for s in stats) + 1
            return await self._move(version, placement, trigger)

    async def _move(self, version: int, placement: dict[str, Any], trigger: str
                    ) -> RebalanceRecord:
        started, t0 = time.time(), time.monotonic()
        answers: list[Rebalanced | Exception] = [Rebalanced(version)] * len(self.pool.clients)
        moved = _moved(self.placement, placement)
        with tracing.tracer().start_as_current_span(
                "eplb rebalance", attributes={"switchyard.placement_version": version,
                                              "switchyard.trigger": trigger,
                                              "switchyard.moved_copies": moved}) as span:
            async def ask(i: int) -> None:
                try:
                    answers[i] = await self.pool.clients[i].rebalance(
                        Rebalance(version, json.dumps(placement)), self.config.timeout_s)
                except Exception as exc:  # a group is down; the record says so
                    answers[i] = exc

            async with anyio.create_task_group() as tg:
                for i in range(len(self.pool.clients)):
                    tg.start_soon(ask, i)
            errors = [str(a) if isinstance(a, Exception) else a.error for a in answers]
            error = next((e for e in errors if e), None)
            done = [a for a in answers if isinstance(a, Rebalanced)]
            record = RebalanceRecord(
                version, started, time.monotonic() - t0,
                max((a.load_s for a in done), default=0.0),
                max((a.switch_s for a in done), default=0.0), moved, trigger, error)
            span.set_attribute("switchyard.load_s", record.load_s)
            if error:
                span.set_attribute("error", error)
        self.history.append(record)
        self._on_record(record)
        if error is None:
            self.placement = placement
            log.warning("eplb: placement version %d in %.2f s (%d expert copies moved, "
                        "load %.2f s)", version, record.duration_s, moved, record.load_s)
        else:
            log.warning("eplb: placement version %d failed: %s", version, error)
        return record


def _moved(old: dict[str, Any] | None, new: dict[str, Any]) -> int:
    """Count the copies `new` puts on a rank that did not hold that expert in `old`.

    Both are placements' JSON. Where `old` is not known, every copy counts.
    """
    count = 0
    before = old["layers"] if old is not None else {}
    for layer, experts in new["layers"].items():
        held = before.get(layer)
        for e, ranks in enumerate(experts):
            count += len(set(ranks) - (set(held[e]) if held else set()))
    return count
