"""Several attention groups behind one gateway: a request goes to the group whose prefix
cache most likely holds its prompt's start, within a balance of load (`prefix_affinity`),
or with `least-busy` routing to the one with the fewest requests in flight.

A request whose group dies is resubmitted (`FailoverGeneration`): to a group that is up,
or the same one once it is back, as its prompt and the tokens it had generated, which
count as its output there (`GenerateRequest.resumed`), so the stream goes on unbroken."""

from __future__ import annotations

import logging
import time

import anyio
import msgspec

from common.auth import NO_SECRET, ClusterSecret
from common.messages import EngineInfo, EngineStats, GenerateRequest, TokenDelta
from gateway.engine_client import EngineClient, Generation
from gateway.errors import GatewayError, engine_unavailable
from gateway.prefix_affinity import POLICIES, PrefixAffinity, block_keys

WARMUP_FAILED = "warm-up failed"  # how /health begins to say it (`switchyard serve` reads it)
# A request is resubmitted at most this many times in a row without a token in between;
# the next loss of its group fails it (a 503): it may be what kills them.
MAX_FRUITLESS_RESUMES = 3
log = logging.getLogger(__name__)


class EnginePool:
    """The same interface as one `EngineClient`, over one client per attention group."""

    def __init__(self, addresses: list[tuple[str, int]], retry_interval_s: float = 1.0,
                 routing: str = "prefix-affinity", balance: int = 16,
                 failover_timeout_s: float = 60.0, secret: ClusterSecret = NO_SECRET,
                 link_timeout_s: float = 5.0) -> None:
        if routing not in POLICIES:
            raise ValueError(f"routing policy {routing!r} is not one of {', '.join(POLICIES)}")
        self.addresses = addresses
        self.failover_timeout_s = failover_timeout_s
        self.resubmitted = 0  # requests sent again after losing their group, since start
        self.clients = [EngineClient(host, port, retry_interval_s, secret, link_timeout_s)
                        for host, port in addresses]
        self._affinity = PrefixAffinity(len(addresses), balance) \
            if routing == "prefix-affinity" and len(addresses) > 1 else None

    @property
    def info(self) -> EngineInfo | None:
        """The served model's description from a connected group (every group serves the
        same model); while none is (every group restarting), the last one seen, so that
        requests are checked and wait for a group (`send_when_up`); None before any."""
        infos = [c.info for c in self.clients if c.info is not None] or \
            [c.last_info for c in self.clients if c.last_info is not None]
        return infos[0] if infos else None

    @property
    def all_connected(self) -> bool:
        """Whether every group is connected and described itself (what /health asks)."""
        return all(c.info is not None for c in self.clients)

    def warmup_problem(self) -> str | None:
        """Why not every group is warm (connected and its warm-up generation came back):
        the first failed warm-up's error, else the groups still warming up; None if all
        are warm."""
        if failed := [c for c in self.clients if c.warmup_error is not None and not c.warm]:
            return (f"{WARMUP_FAILED} on attention service {failed[0].address}: "
                    f"{failed[0].warmup_error}")
        if cold := [c.address for c in self.clients if not c.warm]:
            return f"warming up attention service {', '.join(cold)}"
        return None

    def status(self, stats: list[EngineStats] | None = None) -> list[dict[str, object]]:
        """Each group's address, state and expert ranks: as they are now if `stats`
        (`group_stats`) are given, else as they were when the group connected."""
        return [{"address": f"{h}:{p}", "ready": c.info is not None,
                 "dispatch_backend": c.info.dispatch_backend if c.info else None,
                 "quantization": c.info.quantization if c.info else None,
                 "dense_quantization": c.info.dense_quantization if c.info else None,
                 "experts": (stats[i].expert_services if stats
                             else c.info.expert_services if c.info else [])}
                for i, ((h, p), c) in enumerate(zip(self.addresses, self.clients,
                                                    strict=True))]

    def max_num_seqs(self) -> int:
        """How many sequences the connected groups run at once, together."""
        return sum(c.info.max_num_seqs for c in self.clients if c.info is not None)

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            for client in self.clients:
                tg.start_soon(client.run)
                tg.start_soon(client.keep_warm)

    async def wait_ready(self) -> EngineInfo:
        """Wait until every group is connected (callers bound this); the model's info."""
        infos = [await client.wait_ready() for client in self.clients]
        return infos[0]

    async def any_ready(self) -> None:
        """Until some group is connected (callers bound this)."""
        async with anyio.create_task_group() as tg:
            async def one(client: EngineClient) -> None:
                await client.wait_ready()
                tg.cancel_scope.cancel()

            for client in self.clients:
                tg.start_soon(one, client)

    async def wait_warm(self) -> None:
        """Wait until every group is warm (callers bound this)."""
        for client in self.clients:
            await client.wait_warm()

    async def start(self, request: GenerateRequest) -> FailoverGeneration:
        """Send to a connected group, chosen by the routing policy (waiting up to the
        failover timeout for one, while none is: a group restarting); resubmitted should
        that group die before it ends."""
        return FailoverGeneration(self, request, await self.send_when_up(request))

    async def send_when_up(self, request: GenerateRequest) -> Generation:
        """`send`, once a group is connected, within the failover timeout (past it, the
        503 that no group is)."""
        deadline = time.monotonic() + self.failover_timeout_s
        while True:
            try:
                return await self.send(request)
            except GatewayError:
                if time.monotonic() >= deadline:
                    raise
            with anyio.move_on_after(deadline - time.monotonic()):
                await self.any_ready()

    async def send(self, request: GenerateRequest) -> Generation:
        """Send to a connected group, chosen by the routing policy."""
        loads = {g: c.num_in_flight for g, c in enumerate(self.clients) if c.info is not None}
        if not loads:
            raise engine_unavailable("not connected to any attention service")
        if self._affinity is None:
            group = min(loads, key=loads.__getitem__)
        else:
            info = self.clients[next(iter(loads))].info
            assert info is not None  # (connected)
            keys = block_keys(request.prompt_token_ids, info.block_size, request.cache_salt)
            group = self._affinity.choose(keys, loads, info.num_kv_blocks)
        return await self.clients[group].start(request)

    async def group_stats(self, timeout: float = 10.0) -> list[EngineStats]:
        """Each group's counters."""
        return [await c.stats(timeout) for c in self.clients]

    async def stats(self, timeout: float = 10.0) -> EngineStats:
        """Counters summed over the groups (expert load elementwise)."""
        parts = await self.group_stats(timeout)
        return EngineStats(
            num_running=sum(s.num_running for s in parts),
            num_waiting=sum(s.num_waiting for s in parts),
            kv_blocks_used=sum(s.kv_blocks_used for s in parts),
            num_kv_blocks=sum(s.num_kv_blocks for s in parts),
            num_preemptions=sum(s.num_preemptions for s in parts),
            num_aborted=sum(s.num_aborted for s in parts),
            experts_ready=all(s.experts_ready for s in parts),
            num_steps=sum(s.num_steps for s in parts),
            placement_version=min(s.placement_version for s in parts),  # every group's
            expert_load=[[sum(col) for col in zip(*rows, strict=True)]
                         for rows in zip(*(s.expert_load for s in parts), strict=True)],
        )


class FailoverGeneration:
    """One request's deltas, across the death of the groups that run it: when a group's
    connection goes before the request's last delta, the request is sent again, within
    the pool's failover timeout, to a group that is up (the same one once it is back),
    as its prompt plus the tokens generated so far, which count as its output there
    (`GenerateRequest.resumed`: max_tokens and min_tokens, penalties, the grammar, and
    each seeded draw's position). The deltas go on with the next token: none is missed
    or repeated, and the resumed request's own first-delta fields (queue and prefill
    times, prompt logprobs, cached tokens) are not its. A request resubmitted
    `MAX_FRUITLESS_RESUMES` times in a row without a token fails with a 503 at the next
    loss."""

    def __init__(self, pool: EnginePool, request: GenerateRequest,
                 generation: Generation) -> None:
        self.request_id = request.request_id
        self._pool, self._request, self._generation = pool, request, generation
        self._generated: list[int] = []  # every token sent back so far
        self._fruitless = 0  # groups lost in a row with no token in between

    @property
    def finished(self) -> bool:
        return self._generation.finished

    @property
    def arrived(self) -> float | None:
        return self._generation.arrived

    def __aiter__(self) -> FailoverGeneration:
        return self

    async def __anext__(self) -> TokenDelta:
        while True:
            try:
                delta = await self._generation.__anext__()
            except GatewayError:
                if not self._generation.lost:
                    raise
                await self._resume()
                continue
            self._generated += delta.token_ids
            self._fruitless = 0 if delta.token_ids else self._fruitless
            return delta

    async def _resume(self) -> None:
        """Send the request again (the first group up takes it), or raise the 503 once
        none is up within the failover timeout."""
        self._fruitless += 1
        if self._fruitless > MAX_FRUITLESS_RESUMES:
            raise engine_unavailable(f"request {self.request_id} lost its attention group "
                                     f"{self._fruitless} times in a row without a token")
        original, generated = self._request, self._generated
        sampling = original.sampling  # prompt logprobs came with the first token, if any
        if generated:
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
        request = msgspec.structs.replace(
            original, prompt_token_ids=[*original.prompt_token_ids, *generated],
            sampling=sampling, resumed=len(generated))
        log.warning("request %s lost its attention group after %d tokens: resubmitting",
                    self.request_id, len(generated))
        self._pool.resubmitted += 1
        self._generation = await self._pool.send_when_up(request)

    async def aclose(self) -> None:
        await self._generation.aclose()
