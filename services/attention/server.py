"""The attention service process: the engine behind a `common.rpc` listener.

Connection tasks only queue work. One engine task applies the work between steps, and runs
each step in a worker thread. So the engine is never touched concurrently, and the event
loop keeps answering while the model computes. Deltas go out through each connection's own
outbox and sender task, so a connection that reads slowly delays only itself.

The step runs on the service's one compute thread, from `common.compute`. That thread also
makes each layer's exchange with the experts itself. With `rpc` it uses blocking sockets,
and with the lockstep backends it uses their collectives. The connections to the experts
and their failover never carry a layer call. A step's outputs go out while the next step
runs: the compiled CPU kernels release the GIL, so the event loop sends the outputs
meanwhile.

On a signal the service abandons the step's thread. `Engine.close()` waits for that step
before it leaves the experts and the DCP group. A rank left out of step exits with status 3
without answering its requests. `serve` then restarts its unit, and compose restarts the
services on failure. The gateway resubmits the requests.

The gateway holds one connection per attention group, and multiplexes all its requests over
it by request id. A connection that drops aborts the requests it owns. Work it sent that
still waits is never started. A request refused as a duplicate id does not belong to that
connection. An `AbortRequest` by id from any connection ends a request, which serves as an
operator's tool. A request's token ids are checked against the vocabulary.
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
# The exit status of a rank whose collectives no longer pair with its peers' collectives.
OUT_OF_STEP_EXIT = 3


@dataclass(frozen=True)
class _Work:
    message: GenerateRequest | AbortRequest
    conn: FrameStream


@dataclass
class _Switch:
    """A prepared placement to route by from the next step boundary on.

    `done` is set once the switch happened, with `seconds` saying how long it took, or once
    it failed, with `error` saying why.
    """

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
        self._compute = ComputeThread("engine-step", "attention")  # runs every step on one thread
        self._heartbeat_s = engine.runner.attention.heartbeat_s or math.inf  # DCP leaders only

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
                # The experts load while this connection goes on.
                tg.start_soon(self._rebalance, msg, conn)
            elif isinstance(msg, PlanPlacement):
                await conn.send(await anyio.to_thread.run_sync(plan_placement, msg))
            elif isinstance(msg, GenerateRequest | AbortRequest):
                if isinstance(msg, GenerateRequest) and msg.sampling.grammar is not None:
                    # Compile the grammar here, off the loop. This connection's next message
                    # waits.
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
                    outbox.close()  # the sender ends once it has tried what is queued
        finally:
            # A gateway that went away takes its requests with it. That includes those
            # running for it here, and those it sent that wait to be applied, which `_apply`
            # skips.
            for request_id in [rid for rid, owner in self._owners.items() if owner is conn]:
                self._post(_Work(AbortRequest(request_id), conn))

    async def run_engine(self) -> None:
        """Apply what arrived, run a step, and repeat.

        A step's outputs go out while the next step runs, since the kernels release the
        GIL. So a token's delivery and the gateway's turn cost the step loop nothing.
        """
        lockstep = self.engine.runner.experts.lockstep
        done: list[TokenDelta] = []  # the last step's deltas, sent while the next one runs
        while True:
            if lockstep:
                # Every rank must join every round, so wait for work only briefly.
                with anyio.move_on_after(LOCKSTEP_POLL_S):
                    await self._wakeup.wait()
            elif not self._inbox and not self.engine.has_work():
                for delta in done:  # no step to wait for, so deliver now
                    self._deliver(delta)
                done = []
                with anyio.move_on_after(self._heartbeat_s):
                    await self._wakeup.wait()
                if not self._wakeup.is_set():  # idle that long, so tell the peers
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
        """Send a DCP leader's idle heartbeat.

        If a peer is gone, its collective times out and the group is broken. The rank
        then exits, and the whole group is started again.
        """
        try:
            await self._compute.run(self.engine.heartbeat)
        except Exception as exc:
            log.error("the DCP group's heartbeat failed: %s", root_causes(exc))
            self._out_of_step()

    async def _rebalance(self, msg: Rebalance, conn: FrameStream) -> None:
        """Move the experts to `msg`'s placement.

        The expert ranks load the placement on a worker thread, while steps go on. Then the
        engine routes by it from one step to the next. `Rebalanced` says how long each part
        took, or why the old placement still routes.
        """
        start = time.monotonic()
        try:
            load_s = await anyio.to_thread.run_sync(self.engine.prepare_placement,
                                                    msg.version, msg.placement)
        except Exception as exc:  # not a placement, or a rank could not load it
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
        """The error deltas of a step that raised.

        With `StepFailed`, these are for the step's own sequences. For a failure outside a
        step, they are for every sequence. A rank now out of step with its peers answers
        none of them. It sends `deltas` and exits. The gateway resubmits its requests once
        its unit is back, or to another group.
        """
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
        # A gateway that stopped reading must not keep the peers waiting.
        with anyio.move_on_after(5):
            await self._flushed()
        self._out_of_step()
        return []

    def _left_peers_behind(self, failure: Exception) -> bool:
        """Whether a failed step left peers in collectives that this rank will never join.

        The peers are lockstep expert ranks or DCP ranks. If they were left behind, no
        later round could pair up. A DCP group that aborted the step together, with
        `StepAborted`, is still in step.
        """
        if self.engine.runner.experts.lockstep:
            return True
        return not self.engine.runner.attention.in_step_after(failure)

    def _apply(self, work: _Work) -> TokenDelta | None:
        """Add or abort a request. The abort's delta is returned for its owner.

        A refused request is answered on its own connection and is never owned. Its id may
        be a running request's, whose owner must keep it. A connection that goes away
        aborts only the requests it owns.
        """
        msg = work.message
        # Aborts go by id, from any connection, including an operator's.
        if isinstance(msg, AbortRequest):
            return self.engine.abort(msg.request_id)
        # Its sender went away while it waited, so nobody would read its output.
        if work.conn.closed:
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
        """Put a delta into `conn`'s outbox.

        The outbox is unbounded, as vLLM's and SGLang's output sockets are (ZMQ SNDHWM 0).
        The engine never waits on a connection. A bound would drop a gateway that paused,
        for example for a GC or on a slow host, with all its requests. A connection that is
        gone has no outbox, and its handler aborts its requests.
        """
        if (outbox := self._outboxes.get(conn)) is not None:
            outbox.send_nowait(delta)

    async def _flushed(self) -> None:
        """Wait until every outbox is empty and its sender is back waiting for more.

        By then any delta a sender took has been sent. The caller bounds this wait.
        """
        def busy(outbox: MemoryObjectSendStream[TokenDelta]) -> bool:
            stats = outbox.statistics()
            return bool(stats.current_buffer_used or not stats.tasks_waiting_receive)

        while any(busy(o) for o in self._outboxes.values()):
            await anyio.sleep(0.01)


def plan_placement(msg: PlanPlacement) -> PlacementPlan:
    """EPLB's placement of `msg`'s load, or the error that says why there is none.

    This runs here for the gateway, which has no torch.
    """
    import torch

    from ep_dispatch.eplb import placement_from_load

    try:
        load = torch.tensor(msg.load, dtype=torch.float64)
        placement = placement_from_load(load, msg.moe_layers, msg.num_ranks,
                                        msg.num_redundant, msg.num_groups, msg.num_nodes)
    # A load of the wrong shape, or one that EPLB cannot spread (PlacementError).
    except (ValueError, RuntimeError) as exc:
        return PlacementPlan(error=str(exc))
    return PlacementPlan(placement.to_json())


def _exit_out_of_step() -> None:
    """Exit at once, because cleaning up would wait on collectives the peers never join.

    The launcher, or the container's restart policy, brings the whole world up again.
    """
    log.critical("a failed step left this rank out of step with its peers; exiting "
                 "(status %d) so that every rank restarts", OUT_OF_STEP_EXIT)
    logging.shutdown()
    os._exit(OUT_OF_STEP_EXIT)


async def _send_all(conn: FrameStream, pending: MemoryObjectReceiveStream[TokenDelta]
                    ) -> None:
    """A connection's sender, which sends its deltas in order.

    On a dead connection the deltas are dropped, and its handler aborts its requests. A
    delta that cannot be sent at all is a bug. It costs its connection, never the service.
    """
    async with pending:
        async for delta in pending:
            try:
                await conn.send(delta)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                continue  # the connection is gone; its handler aborts its requests
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
        # Start this before the engine, because an rpc client's thread would keep a failed
        # process alive.
        metrics_port = start_metrics_server(config.host, config.metrics_port, "attention",
                                            config.attention_rank)
        engine = build_engine(config)
        # Release the loading thread's OpenMP team, since steps run on another thread.
        release_threads()
    except (CheckpointError, ValueError, OSError, ExpertRankError, RendezvousError) as exc:
        print(f"switchyard attention: {exc}", file=sys.stderr)
        return 2
    try:
        return run_service("attention", config.host, config.port, serve, config, engine,
                           metrics_port)
    finally:
        # This joins the rpc client's event-loop thread and leaves the torch group.
        engine.close()
