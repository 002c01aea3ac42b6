"""`FailoverGeneration` (gateway/routing/engine_pool.py) against scripted groups that die: what
is resubmitted, and when a request stops being resubmitted. (Real groups killed under
`serve`: tests/e2e/test_failover.py.)"""

from __future__ import annotations

import anyio
import pytest

from common.messages import GenerateRequest, SamplingParams, TokenDelta
from gateway.errors import GatewayError, engine_unavailable
from gateway.routing.engine_client import EngineClient
from gateway.routing.engine_pool import MAX_FRUITLESS_RESUMES, FailoverGeneration
from tests.support.gateway import FakeEngine

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Lost:
    """A generation that yields `tokens` (one delta each), then loses its group, or
    finishes with "length" if `ends`."""

    def __init__(self, tokens: list[int], ends: bool = False) -> None:
        self.deltas = [TokenDelta("r", [t], None, 3) for t in tokens]
        self.ends, self.finished, self.lost, self.arrived = ends, False, False, None

    async def __anext__(self) -> TokenDelta:
        if self.deltas:
            return self.deltas.pop(0)
        if self.ends:
            self.finished = True
            return TokenDelta("r", [], "length", 3)
        self.finished = self.lost = True
        raise engine_unavailable("lost the connection to the engine")

    async def aclose(self) -> None:
        pass


class Pool:
    """Hands out the scripted generations in turn; keeps the requests it was sent."""

    def __init__(self, *generations: Lost) -> None:
        self.generations, self.sent = list(generations), []
        self.resubmitted = 0  # (EnginePool's count, which the dashboard reads)

    async def send_when_up(self, request: GenerateRequest) -> Lost:
        self.sent.append(request)
        return self.generations.pop(0)


def request() -> GenerateRequest:
    return GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=8))


async def drain(gen: FailoverGeneration) -> list[int]:
    tokens = []
    async for delta in gen:
        tokens += delta.token_ids
        if delta.finish_reason is not None:
            break
    return tokens


async def test_a_request_is_resubmitted_with_what_it_streamed() -> None:
    pool = Pool(Lost([7, 8]), Lost([9]), Lost([10], ends=True))
    gen = FailoverGeneration(pool, request(), await pool.send_when_up(request()))  # type: ignore[arg-type]
    assert await drain(gen) == [7, 8, 9, 10]
    assert [(r.prompt_token_ids, r.resumed) for r in pool.sent[1:]] == [
        ([1, 2, 3, 7, 8], 2), ([1, 2, 3, 7, 8, 9], 3)]
    assert pool.resubmitted == 2


async def test_a_request_that_keeps_losing_its_group_without_a_token_fails() -> None:
    """Each group dies before its first token (the request may be what kills them): the
    last loss is a 503 rather than another resubmission."""
    lost = [Lost([5]), *(Lost([]) for _ in range(MAX_FRUITLESS_RESUMES + 1))]
    pool = Pool(*lost)
    gen = FailoverGeneration(pool, request(), await pool.send_when_up(request()))  # type: ignore[arg-type]
    with pytest.raises(GatewayError, match=f"{MAX_FRUITLESS_RESUMES + 1} times in a row"):
        await drain(gen)
    assert len(pool.sent) == 1 + MAX_FRUITLESS_RESUMES
    assert all(r.prompt_token_ids == [1, 2, 3, 5] for r in pool.sent[1:])


async def test_a_connection_reset_during_the_handshake_is_retried() -> None:
    """A group stopping as the gateway reconnects to it resets the connection before the
    handshake's challenge: the client tries again (before, the reset escaped its
    reconnect loop and stopped every group's client: seen as a 503 after a rolling
    upgrade's stop)."""
    engine = FakeEngine([5], eos_id=2)
    engine.resets = 3
    async with engine.running(), anyio.create_task_group() as tg:
        client = EngineClient("127.0.0.1", engine.port, retry_interval_s=0.01)
        tg.start_soon(client.run)
        with anyio.fail_after(10):
            info = await client.wait_ready()
        assert info == engine.info and engine.resets == 0
        tg.cancel_scope.cancel()
