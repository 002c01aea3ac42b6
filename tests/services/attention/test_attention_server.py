"""The attention service's connection handling (`services/attention/server.py`) over real
TCP on loopback: who gets which deltas, and what a connection that goes away takes with it."""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import anyio
import pytest
from anyio import wait_all_tasks_blocked
from anyio.abc import SocketAttribute, SocketStream

from common.auth import NO_SECRET
from common.messages import (
    AbortRequest,
    GenerateRequest,
    SamplingParams,
    StatsRequest,
    TokenDelta,
)
from common.rpc import FrameStream, accept, connect
from dcp.group import StepAborted
from dcp.sharding import Sharding
from dcp.strategy import DcpLeader, SingleRank
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.server import AttentionServer
from tests.support.engines import engine_for

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def attention(path: object) -> AsyncIterator[int]:
    """An attention server over `path` in this process; its port."""
    engine = build_engine(AttentionConfig(model=path, kv_cache_memory=1 << 22))  # type: ignore[arg-type]
    server = AttentionServer(engine)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    async with listener, anyio.create_task_group() as tg:
        async def on_connect(stream: SocketStream) -> None:
            conn = await accept(stream, NO_SECRET, "a test", logging.getLogger(__name__))
            assert conn is not None
            await server.handle(conn)

        tg.start_soon(listener.serve, on_connect)
        tg.start_soon(server.run_engine)
        yield listener.extra(SocketAttribute.local_port)
        tg.cancel_scope.cancel()


@asynccontextmanager
async def two_clients(path: object) -> AsyncIterator[tuple[FrameStream, FrameStream]]:
    """Two connections to an attention server over `path`, within 50 s."""
    with anyio.fail_after(50):
        async with attention(path) as port:
            a = await connect("127.0.0.1", port)
            b = await connect("127.0.0.1", port)
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
        while True:  # both of the leaving connection's requests end: the running one
            # aborted, the queued one aborted or (if not yet applied) never started
            await staying.send(StatsRequest())
            stats = await staying.receive()
            if stats.num_aborted >= 1 and stats.num_running + stats.num_waiting == 0:
                assert stats.num_aborted <= 2
                break
            await anyio.sleep(0.01)  # polling the engine's counters, bounded above


class _FakeEngine:
    """What AttentionServer uses of an Engine; its first step holds until `step_gate`."""

    class runner:  # stands in for the engine's model runner
        class experts:
            lockstep = False

        attention = SingleRank(16, None)  # no DCP group

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.added: dict[str, anyio.Event] = {}
        self.step_gate = threading.Event()
        self.stepped = False

    def add(self, request: GenerateRequest) -> TokenDelta | None:
        if request.request_id in self.live or request.request_id.startswith("bad"):
            return TokenDelta(request.request_id, [], "error", 1, "refused")
        self.live.add(request.request_id)
        self._added(request.request_id).set()
        return None

    def _added(self, request_id: str) -> anyio.Event:
        return self.added.setdefault(request_id, anyio.Event())

    async def wait_added(self, request_id: str) -> None:
        await self._added(request_id).wait()

    def abort(self, request_id: str) -> TokenDelta | None:
        if request_id not in self.live:
            return None
        self.live.discard(request_id)
        return TokenDelta(request_id, [], "abort", 1)

    def has_work(self) -> bool:
        return bool(self.live) and not self.stepped

    def step(self) -> list[TokenDelta]:
        self.step_gate.wait(30)
        self.stepped = True
        return []


class _FakeConn:
    """A connection whose incoming frames the test feeds and whose sends it can hold."""

    def __init__(self, hold_sends: bool = False) -> None:
        self.feed, self._incoming = anyio.create_memory_object_stream[object](10)
        self.sent: list[object] = []
        self.sending, self.release, self.gone = anyio.Event(), anyio.Event(), anyio.Event()
        self.hold_sends, self.closed = hold_sends, False

    async def receive(self) -> object:
        return await self._incoming.receive()

    async def send(self, message: object) -> None:
        self.sent.append(message)
        self.sending.set()
        if self.hold_sends:
            await self.release.wait()

    async def aclose(self) -> None:
        self.closed = True
        self.gone.set()


@asynccontextmanager
async def _served(server: AttentionServer, *conns: object
                  ) -> AsyncIterator[anyio.abc.TaskGroup]:
    """`server`'s engine task and a handler for each connection, for at most 20 s; its
    task group (to add connections), cancelled at the end."""
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.run_engine)
            for conn in conns:
                tg.start_soon(server.handle, conn)
            yield tg
            tg.cancel_scope.cancel()


class _Answering(_FakeEngine):
    """Every step: one token for each live request, which then finishes."""

    def has_work(self) -> bool:
        return bool(self.live)

    def step(self) -> list[TokenDelta]:
        done = [TokenDelta(r, [7], "length", 1) for r in sorted(self.live)]
        self.live.clear()
        return done


async def test_a_connection_that_closes_while_its_request_waits_behind_another_loses_it(
        ) -> None:
    """b's request sits in the batch the engine applies with a's refused one; b goes away
    while a's refusal is still being sent. b's request must end with b (it used to run to
    the end for nobody when the engine itself waited on that send)."""
    engine, a, b = _FakeEngine(), _FakeConn(hold_sends=True), _FakeConn()
    server = AttentionServer(engine)  # type: ignore[arg-type]
    async with _served(server, a, b):
        await a.feed.send(greedy("first", 4))  # runs a step that holds...
        await engine.wait_added("first")
        await a.feed.send(greedy("bad", 4))  # ...while these two queue together
        await b.feed.send(greedy("b's", 4))
        await wait_all_tasks_blocked()
        engine.step_gate.set()
        await a.sending.wait()  # the refusal of "bad" is held mid-send
        await b.feed.aclose()
        await b.gone.wait()
        a.release.set()
        await a.feed.send(greedy("probe", 4))  # applied after everything before it
        await engine.wait_added("probe")
        assert "b's" not in engine.live


async def test_a_connection_going_away_aborts_only_what_it_owns() -> None:
    """A connection that sent a running request's id and goes away leaves that request
    alone: whether it left before its duplicate was applied (it used to abort the
    original) or after the duplicate was refused. An explicit abort by id, from any
    connection, still ends it: an operator's tool."""
    engine, a, b = _FakeEngine(), _FakeConn(), _FakeConn()
    server = AttentionServer(engine)  # type: ignore[arg-type]
    async with _served(server, a, b) as tg:
        await a.feed.send(greedy("r", 4))
        await engine.wait_added("r")  # and a step holds the engine...
        await b.feed.send(greedy("r", 4))  # ...while a's id arrives from b, which
        await b.feed.aclose()  # goes away before it is refused
        await b.gone.wait()
        await wait_all_tasks_blocked()
        engine.step_gate.set()
        await a.feed.send(greedy("probe", 4))
        await engine.wait_added("probe")
        assert "r" in engine.live  # b's going away aborted a's "r" before
        c = _FakeConn()
        tg.start_soon(server.handle, c)
        await c.feed.send(greedy("r", 4))  # refused while c is still there...
        await c.sending.wait()
        await c.feed.aclose()  # ...then c goes away
        await c.gone.wait()
        await a.feed.send(greedy("probe 1", 4))
        await engine.wait_added("probe 1")
        assert "r" in engine.live
        assert [d.finish_reason for d in c.sent] == ["error"]  # type: ignore[attr-defined]
        await a.feed.send(AbortRequest("r"))
        await a.feed.send(greedy("probe 2", 4))
        await engine.wait_added("probe 2")
        assert "r" not in engine.live


def test_closing_the_engine_waits_for_the_step_another_thread_runs(qwen3_ckpt: tuple
                                                                   ) -> None:
    """On a signal the service abandons its step's thread and closes the engine: the
    experts (and a DCP group) must not be closed under that step's exchanges."""
    engine = engine_for(qwen3_ckpt[0])
    engine.add(greedy("r", 4))
    entered, release, order = threading.Event(), threading.Event(), []
    schedule, close_experts = engine.scheduler.schedule, engine.runner.experts.close

    def held_schedule() -> list:
        entered.set()
        release.wait(30)
        return schedule()

    engine.scheduler.schedule = held_schedule  # type: ignore[method-assign]
    engine.runner.experts.close = lambda: (  # type: ignore[method-assign]
        order.append("experts closed"), close_experts())
    stepper = threading.Thread(target=lambda: (engine.step(), order.append("step ended")))
    stepper.start()
    assert entered.wait(30)
    waiting, lock = threading.Event(), engine._stepping

    class Watched:  # the step's lock, telling when close() starts to wait for it
        def acquire(self, timeout: float = -1) -> bool:
            waiting.set()
            return lock.acquire(timeout=timeout)

        def release(self) -> None:
            lock.release()

    engine._stepping = Watched()  # type: ignore[assignment]
    closer = threading.Thread(target=engine.close)
    closer.start()
    assert waiting.wait(30)
    release.set()
    stepper.join(30)
    closer.join(30)
    assert order == ["step ended", "experts closed"]
    engine._stepping = lock
    assert engine.step() == []  # a worker thread that starts a step after close: nothing


def test_closing_under_a_step_that_never_ends_gives_up_after_its_timeout(
        qwen3_ckpt: tuple, caplog: pytest.LogCaptureFixture) -> None:
    engine = engine_for(qwen3_ckpt[0])
    assert engine._stepping.acquire()  # a step that hangs (a peer that died, say)
    closed, close_experts = [], engine.runner.experts.close
    engine.runner.experts.close = lambda: (closed.append(True), close_experts())  # type: ignore
    engine.close(timeout=0.1)
    assert "did not end within" in caplog.text and closed == [True]


_LEADER = DcpLeader(SimpleNamespace(attend=None), Sharding(2, 1), 16,  # type: ignore[arg-type]
                    None)  # its group is never called here


@pytest.mark.parametrize(("lockstep", "attention", "failure", "leaves"), [
    (True, SingleRank(16, None), RuntimeError("a collective failed"), True),
    (False, _LEADER, RuntimeError("attention's all_gather failed"), True),
    (False, _LEADER, StepAborted("expert rank 1 failed"), False),  # the group knows: in step
    (False, SingleRank(16, None), RuntimeError("a bug"), False),  # alone: nobody waits on it
])
async def test_a_failed_step_fails_its_requests_or_leaves_the_world_if_out_of_step(
        lockstep: bool, attention: SingleRank, failure: Exception, leaves: bool) -> None:
    """A rank whose peers wait in collectives it will never join (lockstep expert ranks;
    a DCP group told nothing) exits without answering (the launcher or compose restarts
    its unit, and the gateway resubmits its requests). A DCP group that aborted the step
    together, or a rank without peers, fails the step's requests and serves on."""
    class Failing(_FakeEngine):
        def has_work(self) -> bool:
            return bool(self.live)

        def step(self) -> list[TokenDelta]:
            raise failure

        def fail_all(self, error: str) -> list[TokenDelta]:
            failed = [TokenDelta(r, [], "error", 1, error) for r in sorted(self.live)]
            self.live.clear()
            return failed

    engine, a, left = Failing(), _FakeConn(), anyio.Event()
    engine.runner = type("Runner", (), {  # type: ignore[misc]
        "experts": type("Experts", (), {"lockstep": lockstep}), "attention": attention})
    at_exit: list[list[object]] = []  # what the connection had when the rank would exit

    def out_of_step() -> None:
        at_exit.append(list(a.sent))
        left.set()

    server = AttentionServer(engine, out_of_step=out_of_step)  # type: ignore[arg-type]
    async with _served(server, a):
        await a.feed.send(greedy("r", 4))
        if leaves:
            await left.wait()
            assert at_exit == [[]]  # "r" unanswered: the gateway resubmits it
            return
        await a.sending.wait()
        sent: list[TokenDelta] = a.sent  # type: ignore[assignment]
        assert [(d.request_id, d.finish_reason) for d in sent] == [("r", "error")]
        assert str(failure) in (sent[0].error or "")
        await a.feed.send(greedy("next", 4))  # applied after the failed step's end
        await engine.wait_added("next")
        assert not left.is_set()


async def test_a_connection_that_does_not_read_delays_only_itself() -> None:
    """Each connection has its own sender: one whose sends never complete (a gateway
    that stopped reading) must not hold the engine, nor another connection's deltas."""
    engine, stuck, fine = _Answering(), _FakeConn(hold_sends=True), _FakeConn()
    server = AttentionServer(engine)  # type: ignore[arg-type]
    async with _served(server, stuck, fine):
        await stuck.feed.send(greedy("s", 4))
        await stuck.sending.wait()  # its answer will never finish sending
        for i in range(3):
            await fine.feed.send(greedy(f"f{i}", 4))
            await fine.sending.wait()
            fine.sending = anyio.Event()
        sent: list[TokenDelta] = fine.sent  # type: ignore[assignment]
        assert [(d.request_id, d.finish_reason) for d in sent] == [
            ("f0", "length"), ("f1", "length"), ("f2", "length")]


async def test_a_delta_that_cannot_be_sent_costs_its_connection_not_the_service() -> None:
    """A send that fails other than on a closed connection (msgspec refuses a lone
    surrogate in an error text, say): that connection is dropped, the others go on."""
    class Unsendable(_FakeConn):
        async def send(self, message: object) -> None:
            raise UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed")

    engine, bad, fine = _Answering(), Unsendable(), _FakeConn()
    server = AttentionServer(engine)  # type: ignore[arg-type]
    async with _served(server, bad, fine):
        await bad.feed.send(greedy("b", 4))
        await bad.gone.wait()  # dropped...
        await fine.feed.send(greedy("f", 4))  # ...and the service still serves
        await fine.sending.wait()
        assert [d.request_id for d in fine.sent] == ["f"]  # type: ignore[attr-defined]
