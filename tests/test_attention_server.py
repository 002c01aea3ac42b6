"""The attention service's connection handling (`services/attention/server.py`) over real
TCP on loopback: who gets which deltas, and what a connection that goes away takes with it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
from anyio.abc import SocketAttribute

from services.attention.config import AttentionConfig
from services.attention.engine import Engine
from services.attention.server import AttentionServer
from switchyard.messages import GenerateRequest, SamplingParams, StatsRequest, TokenDelta
from switchyard.rpc import FrameStream

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def attention(path: object) -> AsyncIterator[int]:
    """An attention server over `path` in this process; its port."""
    engine = Engine(AttentionConfig(model=path, kv_cache_memory=1 << 22))  # type: ignore[arg-type]
    server = AttentionServer(engine)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, lambda stream: server.handle(FrameStream(stream)))
        tg.start_soon(server.run_engine)
        yield listener.extra(SocketAttribute.local_port)
        tg.cancel_scope.cancel()


@asynccontextmanager
async def two_clients(path: object) -> AsyncIterator[tuple[FrameStream, FrameStream]]:
    """Two connections to an attention server over `path`, within 50 s."""
    with anyio.fail_after(50):
        async with attention(path) as port:
            a = FrameStream(await anyio.connect_tcp("127.0.0.1", port))
            b = FrameStream(await anyio.connect_tcp("127.0.0.1", port))
            try:
                yield a, b
            finally:
                await a.aclose()
                await b.aclose()


def greedy(request_id: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id, PROMPT, SamplingParams(max_tokens=max_tokens,
                                                              temperature=0, ignore_eos=True))


async def until_finished(conn: FrameStream, first: TokenDelta) -> list[TokenDelta]:
    deltas = [first]
    while deltas[-1].finish_reason is None:
        delta = await conn.receive()
        assert isinstance(delta, TokenDelta) and delta.request_id == first.request_id
        deltas.append(delta)
    return deltas


async def test_a_reused_request_id_is_refused_to_its_sender_and_the_first_goes_on(
        qwen3_ckpt: tuple) -> None:
    async with two_clients(qwen3_ckpt[0]) as (a, b):
        await a.send(greedy("r", 12))
        first = await a.receive()
        assert isinstance(first, TokenDelta) and first.finish_reason is None
        await b.send(greedy("r", 3))  # the same id from elsewhere, while "r" runs
        refused = await b.receive()
        assert isinstance(refused, TokenDelta) and refused.finish_reason == "error"
        assert "already running" in (refused.error or "")
        deltas = await until_finished(a, first)
        assert deltas[-1].finish_reason == "length"
        assert sum(len(d.token_ids) for d in deltas) == 12  # every token, to its owner


async def test_a_connection_that_goes_away_aborts_its_requests_and_only_its_own(
        qwen3_ckpt: tuple) -> None:
    async with two_clients(qwen3_ckpt[0]) as (leaving, staying):
        await leaving.send(greedy("gone-running", 400))
        assert isinstance(await leaving.receive(), TokenDelta)  # it runs
        await staying.send(greedy("kept", 30))
        first = await staying.receive()
        await leaving.send(greedy("gone-queued", 400))  # sent, then straight away:
        await leaving.aclose()
        deltas = await until_finished(staying, first)
        assert deltas[-1].finish_reason == "length"
        while True:  # both of the leaving connection's requests end, aborted
            await staying.send(StatsRequest())
            stats = await staying.receive()
            if stats.num_aborted == 2 and stats.num_running + stats.num_waiting == 0:
                break
            await anyio.sleep(0.01)  # polling the engine's counters, bounded above
