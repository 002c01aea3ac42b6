"""Several attention groups behind one gateway.

A request goes to the group whose prefix cache most likely holds the start of its prompt,
within a balance of load; see `prefix_affinity`. With `least-busy` routing it goes to the
group with the fewest requests in flight.

`FailoverGeneration` resubmits a request whose group dies. It goes to a group that is up,
or to the same one once it is back. The new request is the prompt plus the tokens
generated so far, which count as its output there (`GenerateRequest.resumed`). This way
the stream goes on unbroken.
"""

from __future__ import annotations

import logging
import time

import anyio
import msgspec

from common.auth import NO_SECRET, ClusterSecret
from common.messages import EngineInfo, EngineStats, GenerateRequest, TokenDelta
from gateway.errors import GatewayError, engine_unavailable
from gateway.routing.engine_client import EngineClient, Generation
from gateway.routing.prefix_affinity import POLICIES, PrefixAffinity, block_keys

# How /health's message begins for a failed warm-up. `switchyard serve` looks for it.
WARMUP_FAILED = "warm-up failed"
# A request is resubmitted at most this many times in a row without a token in between.
# The next loss of its group fails it with a 503, because the request itself may be what
# kills the groups.
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
        """The served model's description from a connected group.

        Every group serves the same model. While no group is connected, for example while
        every group restarts, this is the last description seen. That way requests are
        still checked, and wait for a group in `send_when_up`. It is None before any group
        has connected.
        """
        infos = [c.info for c in self.clients if c.info is not None] or \
            [c.last_info for c in self.clients if c.last_info is not None]
        return infos[0] if infos else None

    @property
    def all_connected(self) -> bool:
        """Whether every group is connected and has described itself. /health asks this."""
        return all(c.info is not None for c in self.clients)

    def warmup_problem(self) -> str | None:
        """Why not every group is warm, or None if all are.

        A group is warm once it is connected and its warm-up generation has come back.
        The reason is the first failed warm-up's error, or else the list of groups still
        warming up.
        """
        if failed := [c for c in self.clients if c.warmup_error is not None and not c.warm]:
            return (f"{WARMUP_FAILED} on attention service {failed[0].address}: "
                    f"{failed[0].warmup_error}")
        if cold := [c.address for c in self.clients if not c.warm]:
            return f"warming up attention service {', '.join(cold)}"
        return None

    def status(self, stats: list[EngineStats] | None = None) -> list[dict[str, object]]:
        """Each group's address, state and expert ranks.

        With `stats` from `group_stats`, the expert ranks are as they are now. Without them,
        they are as they were when the group connected.
        """
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
        """Wait until every group is connected, and return the model's info.

        Callers bound this wait.
        """
        infos = [await client.wait_ready() for client in self.clients]
        return infos[0]

    async def any_ready(self) -> None:
        """Wait until some group is connected. Callers bound this wait."""
        async with anyio.create_task_group() as tg:
            async def one(client: EngineClient) -> None:
                await client.wait_ready()
                tg.cancel_scope.cancel()

            for client in self.clients:
                tg.start_soon(one, client)

    async def wait_warm(self) -> None:
        """Wait until every group is warm. Callers bound this wait."""
        for client in self.clients:
            await client.wait_warm()

    async def start(self, request: GenerateRequest) -> FailoverGeneration:
        """Send to a connected group, chosen by the routing policy.

        While no group is connected, for example while a group restarts, this waits up to
        the failover timeout for one. If that group dies before the request ends, the
        request is resubmitted.
        """
        return FailoverGeneration(self, request, await self.send_when_up(request))

    async def send_when_up(self, request: GenerateRequest) -> Generation:
        """`send` once a group is connected, waiting up to the failover timeout.

        Past the timeout, it raises the 503 that says no group is connected.
        """
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
            assert info is not None  # the group is connected
            keys = block_keys(request.prompt_token_ids, info.block_size, request.cache_salt)
            group = self._affinity.choose(keys, loads, info.num_kv_blocks)
        return await self.clients[group].start(request)

    async def group_stats(self, timeout: float = 10.0) -> list[EngineStats]:
        """Each group's counters."""
        return [await c.stats(timeout) for c in self.clients]

    async def stats(self, timeout: float = 10.0) -> EngineStats:
        """Counters summed over the groups. Expert load is summed elementwise."""
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
            placement_version=min(s.placement_version for s in parts),  # reached by every group
            expert_load=[[sum(col) for col in zip(*rows, strict=True)]
                         for rows in zip(*(s.expert_load for s in parts), strict=True)],
        )


class FailoverGeneration:
    """One request's deltas, even across the death of the groups that run it.

    When a group's connection goes before the request's last delta, the request is sent
    again within the pool's failover timeout. It goes to a group that is up, or to the same
    one once it is back. The new request is the prompt plus the tokens generated so far,
    which count as its output there (`GenerateRequest.resumed`). They count towards
    max_tokens and min_tokens, penalties, the grammar, and each seeded draw's position.

    The deltas go on with the next token, so none is missed or repeated. The resumed
    request's own first-delta fields do not belong to the original request. Those are
    queue and prefill times, prompt logprobs and cached tokens. A request resubmitted
    `MAX_FRUITLESS_RESUMES` times in a row without a token fails with a 503 at the next
    loss.
    """

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
        """Send the request again, to the first group that is up.

        Raises the 503 if no group is up within the failover timeout.
        """
        self._fruitless += 1
        if self._fruitless > MAX_FRUITLESS_RESUMES:
            raise engine_unavailable(f"request {self.request_id} lost its attention group "
                                     f"{self._fruitless} times in a row without a token")
        original, generated = self._request, self._generated
        # Prompt logprobs came with the first token, if any, so they are not asked again.
        sampling = original.sampling
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
