"""The attention service process: the engine behind a `common.rpc` listener.

Connection tasks only queue work; one engine task applies it between steps and runs each
step in a worker thread, so the engine is never touched concurrently and the event loop
keeps answering while the model computes. Deltas go out through each connection's own
outbox and sender task: a connection that reads slowly delays only itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from common.auth import check_listen
from common.compute import ComputeThread
from common.failures import root_causes
from common.messages import (
    AbortRequest,
    GenerateRequest,
    InfoRequest,
    Message,
    PlacementPlan,
    PlanPlacement,
    Rebalance,
    Rebalanced,
    StatsRequest,
    TokenDelta,
)
from common.metrics import report_ready, start_metrics_server
from common.rpc import (
    FrameStream,
    accept,
    cancel_on_signal,
    peer_of,
    run_service,
    serve_messages,
)
from common.tracing import setup_tracing
from ep_dispatch.rpc_pool import ExpertRankError
from ep_dispatch.torch_dist import RendezvousError
from moe_kernels.cpu_kernels import release_threads
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine, StepFailed
from services.model.config import CheckpointError

log = logging.getLogger("switchyard.attention")
LOCKSTEP_POLL_S = 0.002  # idle round cadence of collective backends
OUT_OF_STEP_EXIT = 3  # the status of a rank whose collectives no longer pair with its peers'


@dataclass(frozen=True)
class _Work:
    message: GenerateRequest | AbortRequest
    conn: FrameStream


@dataclass
class _Switch:
    """A prepared placement to route by from the next step boundary on; `done` once it
    does (`seconds` the switch took), or failed (`error`)."""

    version: int
    done: anyio.Event
    seconds: float = 0.0
    error: str | None = None


class AttentionServer:
    def __init__(self, engine: Engine, out_of_step: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self._inbox: list[_Work] = []
        self._switches: list[_Switch] = []
        self._wakeup = anyio.Event()
        self._owners: dict[str, FrameStream] = {}
        self._outboxes: dict[FrameStream, MemoryObjectSendStream[TokenDelta]] = {}
        self._out_of_step = out_of_step or _exit_out_of_step
        self._compute = ComputeThread("engine-step", "attention")  # every step on one thread
        self._heartbeat_s = engine.runner.attention.heartbeat_s or math.inf  # a DCP leader's

    def _post(self, work: _Work) -> None:
        self._inbox.append(work)
        self._wakeup.set()

    async def handle(self, conn: FrameStream) -> None:
        async def on_message(msg: Message) -> None:
            if isinstance(msg, InfoRequest):
                await conn.send(self.engine.info())
            elif isinstance(msg, StatsRequest):
                await conn.send(self.engine.stats())
            elif isinstance(msg, Rebalance):
                tg.start_soon(self._rebalance, msg, conn)  # loads while this connection goes on
            elif isinstance(msg, PlanPlacement):
                await conn.send(await anyio.to_thread.run_sync(plan_placement, msg))
            elif isinstance(msg, GenerateRequest | AbortRequest):
                if isinstance(msg, GenerateRequest) and msg.sampling.grammar is not None:
                    # compiled here, off the loop; this connection's next message waits
                    await anyio.to_thread.run_sync(self.engine.grammars.prepare,
                                                   msg.sampling.grammar)
                self._post(_Work(msg, conn))
            else:
                log.warning("ignoring unexpected %s", type(msg).__name__)

        outbox, pending = anyio.create_memory_object_stream[TokenDelta](math.inf)
        self._outboxes[conn] = outbox
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_send_all, conn, pending)
                try:
                    await serve_messages(conn, on_message, log)
                finally:
                    del self._outboxes[conn]
                    outbox.close()  # the sender ends once what is queued has been tried
        finally:
            # A gateway that went away takes its requests with it: those running for it
            # here, and (`_apply` skips them) those it sent that wait to be applied.
            for request_id in [rid for rid, owner in self._owners.items() if owner is conn]:
                self._post(_Work(AbortRequest(request_id), conn))

    async def run_engine(self) -> None:
        """Apply what arrived, run a step, repeat. A step's outputs go out while the next
        step runs (the kernels release the GIL), so a token's delivery and the gateway's
        turn cost the step loop nothing."""
        lockstep = self.engine.runner.experts.lockstep
        done: list[TokenDelta] = []  # the last step's, delivered while the next one runs
        while True:
            if lockstep:
                # Every rank must join every round: wait for work only briefly.
                with anyio.move_on_after(LOCKSTEP_POLL_S):
                    await self._wakeup.wait()
            elif not self._inbox and not self.engine.has_work():
                for delta in done:  # no step to wait for: now
                    self._deliver(delta)
                done = []
                with anyio.move_on_after(self._heartbeat_s):
                    await self._wakeup.wait()
                if not self._wakeup.is_set():  # idle that long: the peers hear of it
                    await self._heartbeat()
                    continue
            self._wakeup = anyio.Event()
            inbox, self._inbox = self._inbox, []
            deltas = [d for work in inbox if (d := self._apply(work))]
            switches, self._switches = self._switches, []
            for switch in switches:  # between two steps, on the step's thread
                await self._switch(switch)
            running = self._compute.start(self.engine.step) \
                if lockstep or self.engine.has_work() else None
            for delta in done:
                self._deliver(delta)
            done = deltas
            if running is not None:
                try:
                    done += await running
                except Exception as exc:  # a bug must cost its batch, not the service
                    done += await self._step_failed(exc, deltas)

    async def _heartbeat(self) -> None:
        """A DCP leader's idle heartbeat; a peer gone (its collective timed out) leaves
        the group broken: exit, and the group is started again whole."""
        try:
            await self._compute.run(self.engine.heartbeat)
        except Exception as exc:
            log.error("the DCP group's heartbeat failed: %s", root_causes(exc))
            self._out_of_step()

    async def _rebalance(self, msg: Rebalance, conn: FrameStream) -> None:
        """Move the experts to `msg`'s placement: the expert ranks load it (on a worker
        thread, while steps go on), then the engine routes by it from one step to the
        next; `Rebalanced` says how long each part took, or why the old one still routes."""
        start = time.monotonic()
        try:
            load_s = await anyio.to_thread.run_sync(self.engine.prepare_placement,
                                                    msg.version, msg.placement)
        except Exception as exc:  # not a placement, or a rank that could not load it
            log.warning("rebalance to placement version %d failed: %s", msg.version,
                        root_causes(exc))
            answer = Rebalanced(msg.version, error=root_causes(exc))
        else:
            prepare_s = time.monotonic() - start
            switch = _Switch(msg.version, anyio.Event())
            self._switches.append(switch)
            self._wakeup.set()
            await switch.done.wait()
            answer = Rebalanced(msg.version, load_s, prepare_s, switch.seconds, switch.error)
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            await conn.send(answer)

    async def _switch(self, switch: _Switch) -> None:
        start = time.monotonic()
        try:
            await self._compute.run(self.engine.switch_placement, switch.version)
            log.info("routing by placement version %d", switch.version)
        except Exception as exc:
            switch.error = f"switching to placement version {switch.version}: " \
                           f"{root_causes(exc)}"
            log.warning("%s", switch.error)
        switch.seconds = time.monotonic() - start
        switch.done.set()

    async def _step_failed(self, exc: Exception, deltas: list[TokenDelta]
                           ) -> list[TokenDelta]:
        """The error deltas of a step that raised: its own sequences' (`StepFailed`), or
        every sequence's (a failure outside a step). A rank now out of step with its
        peers answers none: it sends `deltas` and exits, and the gateway resubmits its
        requests once its unit is back (or to another group)."""
        cause = exc.__cause__ if isinstance(exc, StepFailed) else exc
        assert isinstance(cause, Exception)
        log.error("engine step failed: %s", root_causes(cause), exc_info=cause)
        error = f"internal engine error: {root_causes(cause)}"
        if not self._left_peers_behind(cause):
            if isinstance(exc, StepFailed):
                return self.engine.fail(exc.request_ids, error)
            return self.engine.fail_all(error)
        for delta in deltas:
            self._deliver(delta)
        with anyio.move_on_after(5):  # a gateway that stopped reading
            await self._flushed()  # must not keep the peers waiting
        self._out_of_step()
        return []

    def _left_peers_behind(self, failure: Exception) -> bool:
        """Whether a failed step left peers (lockstep expert ranks, DCP ranks) in
        collectives this rank will never join: then no later round could pair up. A DCP
        group that aborted the step together (`StepAborted`) is still in step."""
        if self.engine.runner.experts.lockstep:
            return True
        return not self.engine.runner.attention.in_step_after(failure)

    def _apply(self, work: _Work) -> TokenDelta | None:
        """Add or abort; the abort's delta is returned for its owner. A refused request
        is answered on its own connection and never owned: its id may be a running
        request's, whose owner must keep it (a connection that goes away aborts only the
        requests it owns)."""
        msg = work.message
        if isinstance(msg, AbortRequest):  # by id, from any connection (an operator's too)
            return self.engine.abort(msg.request_id)
        if work.conn.closed:  # its sender went away while it waited: nobody would read it
            return None
        try:
            refused = self.engine.add(msg)
        except Exception as exc:  # a bug must cost this request, not the service
            log.error("adding request %s failed: %s", msg.request_id, root_causes(exc),
                      exc_info=exc)
            refused = TokenDelta(msg.request_id, [], "error", len(msg.prompt_token_ids),
                                 f"internal engine error: {root_causes(exc)}", retryable=True)
        if refused is None:
            self._owners[msg.request_id] = work.conn
        else:
            self._queue(work.conn, refused)
        return None

    def _deliver(self, delta: TokenDelta) -> None:
        conn = self._owners.get(delta.request_id)
        if delta.finish_reason is not None:
            self._owners.pop(delta.request_id, None)
        if conn is not None:
            self._queue(conn, delta)

    def _queue(self, conn: FrameStream, delta: TokenDelta) -> None:
        """Into `conn`'s outbox, unbounded as vLLM's and SGLang's output sockets are
        (ZMQ SNDHWM 0): the engine never waits on a connection, and a bound would drop a
        gateway that paused (a GC, a slow host) with all its requests. A connection that
        is gone has no outbox, and its handler aborts its requests."""
        if (outbox := self._outboxes.get(conn)) is not None:
            outbox.send_nowait(delta)

    async def _flushed(self) -> None:
        """Until every outbox is empty and its sender back waiting for more (a delta it
        took is sent by then), bounded by the caller."""
        def busy(outbox: MemoryObjectSendStream[TokenDelta]) -> bool:
            stats = outbox.statistics()
            return bool(stats.current_buffer_used or not stats.tasks_waiting_receive)

        while any(busy(o) for o in self._outboxes.values()):
            await anyio.sleep(0.01)


def plan_placement(msg: PlanPlacement) -> PlacementPlan:
    """EPLB's placement of `msg`'s load (for the gateway, which has no torch), or the
    error that says why there is none."""
    import torch

    from ep_dispatch.eplb import placement_from_load

    try:
        load = torch.tensor(msg.load, dtype=torch.float64)
        placement = placement_from_load(load, msg.moe_layers, msg.num_ranks,
                                        msg.num_redundant, msg.num_groups, msg.num_nodes)
    except (ValueError, RuntimeError) as exc:  # a load of the wrong shape; one that EPLB
        return PlacementPlan(error=str(exc))  # cannot spread (PlacementError)
    return PlacementPlan(placement.to_json())


def _exit_out_of_step() -> None:
    """Exit at once: cleaning up would wait on collectives the peers never join. The
    launcher (or the container's restart policy) brings the whole world up again."""
    log.critical("a failed step left this rank out of step with its peers; exiting "
                 "(status %d) so that every rank restarts", OUT_OF_STEP_EXIT)
    logging.shutdown()
    os._exit(OUT_OF_STEP_EXIT)


async def _send_all(conn: FrameStream, pending: MemoryObjectReceiveStream[TokenDelta]
                    ) -> None:
    """A connection's sender: its deltas in order. On a dead connection they are dropped
    (its handler aborts its requests); a delta that cannot be sent at all (a bug) costs
    its connection, never the service."""
    async with pending:
        async for delta in pending:
            try:
                await conn.send(delta)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                continue  # gone: its handler aborts its requests
            except Exception:
                log.exception("dropping a connection whose delta could not be sent")
                await conn.aclose()


async def serve(config: AttentionConfig, engine: Engine, metrics_port: int | None) -> None:
    server = AttentionServer(engine)
    listener = await anyio.create_tcp_listener(local_host=config.host, local_port=config.port)
    port = listener.extra(SocketAttribute.local_port)
    log.info("attention service listening on %s:%d", config.host, port)
    report_ready(config.ready_fd, port, metrics_port)

    async def on_connect(stream: SocketStream) -> None:
        conn = await accept(stream, config.secret, peer_of(stream), log, config.link_timeout)
        if conn is not None:
            await server.handle(conn)

    async with anyio.create_task_group() as tg:
        tg.start_soon(server.run_engine)
        tg.start_soon(cancel_on_signal, tg.cancel_scope)
        await listener.serve(on_connect)


def main(config: AttentionConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s attention %(message)s")
    setup_tracing("switchyard-attention", config.otlp_traces_endpoint)
    if config.dcp_rank > 0:
        from services.attention.dcp_peer import run_peer

        try:
            run_peer(config)
        except (CheckpointError, ValueError, OSError) as exc:
            print(f"switchyard attention (DCP rank {config.dcp_rank}): {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        check_listen(config.host, config.secret)
        # Before the engine: an rpc client's thread would keep a failed process alive.
        metrics_port = start_metrics_server(config.host, config.metrics_port, "attention",
                                            config.attention_rank)
        engine = build_engine(config)
        release_threads()  # the loading thread's OpenMP team: steps run on another
    except (CheckpointError, ValueError, OSError, ExpertRankError, RendezvousError) as exc:
        print(f"switchyard attention: {exc}", file=sys.stderr)
        return 2
    try:
        return run_service("attention", config.host, config.port, serve, config, engine,
                           metrics_port)
    finally:
        engine.close()  # joins the rpc client's event-loop thread, leaves the torch group
