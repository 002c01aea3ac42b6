"""The expert service process: an `ExpertBank` behind a `common.rpc` listener.

Any number of attention ranks connect (M:N). Each `ExpertBatch` is computed in a worker
thread, one at a time, and answered on the connection it came from.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

import anyio
import torch
from anyio.abc import SocketAttribute, SocketStream
from opentelemetry.trace import set_span_in_context

from common import tracing
from common.device import check_device, resolve_dtype
from common.failures import root_causes
from common.messages import ExpertBatch, ExpertInfo, ExpertResult, InfoRequest, Message
from common.metrics import report_ready, start_metrics_server
from common.rpc import FrameStream, cancel_on_signal, run_service, serve_messages
from common.tracing import setup_tracing
from ep_dispatch.placement import make_placement
from ep_dispatch.registry import ExpertSide, WorldSettings, backend
from ep_dispatch.torch_dist import (
    RendezvousError,
    World,
)
from ep_dispatch.wire import from_wire, to_wire
from services.expert.config import ExpertConfig
from services.model.checkpoint import Checkpoint
from services.model.config import CheckpointError, ModelConfig
from services.model.experts import ExpertBank

log = logging.getLogger("switchyard.expert")


class ExpertServer:
    def __init__(self, config: ExpertConfig) -> None:
        if not 0 <= config.rank < config.num_ranks:
            raise ValueError(f"--rank {config.rank} is outside 0..{config.num_ranks - 1}")
        check_device(config.device, "expert")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = model_config = ModelConfig.from_dir(config.model)
        moe_layers = model_config.moe_layer_ids
        self.placement = make_placement(moe_layers, model_config.num_experts, config.num_ranks,
                                        config.placement, config.expert_replicas)
        checkpoint = Checkpoint(config.model)
        self.bank = ExpertBank(model_config, checkpoint,
                               self.placement.local_experts(config.rank),
                               resolve_dtype(config.dtype, config.device), config.quantization,
                               config.rank, config.device)
        checkpoint.close()
        self.backend = backend(config.dispatch_backend, config.device, self.bank.quantization)
        self._queue: list[tuple[ExpertBatch, FrameStream]] = []
        self._arrived = anyio.Event()
        self.num_coalesced = 0  # batches that shared a GEMM with an earlier one

    def info(self) -> ExpertInfo:
        return ExpertInfo(self.config.rank, self.config.num_ranks, self.bank.experts,
                          self.bank.nbytes(), self.bank.quantization)

    def _check(self, batch: ExpertBatch) -> torch.Tensor:
        x = from_wire(batch.x)
        if batch.layer not in self.bank.experts:
            raise ValueError(f"layer {batch.layer} is not an MoE layer")
        if len(batch.tokens_per_expert) != len(self.bank.experts[batch.layer]) or \
                min(batch.tokens_per_expert, default=0) < 0 or \
                sum(batch.tokens_per_expert) != x.shape[0] or x.ndim != 2 or \
                x.shape[1] != self.bank.rows.width or \
                (x.dtype == torch.uint8) != (self.bank.quantization == "w4a4"):
            raise ValueError("the batch does not match this rank's experts or hidden size")
        return x

    def compute(self, batches: list[ExpertBatch]) -> list[ExpertResult]:
        """Answer batches of one layer (from any attention ranks) with one grouped GEMM."""
        results: dict[int, ExpertResult] = {}
        valid: list[tuple[int, ExpertBatch, torch.Tensor]] = []
        for i, batch in enumerate(batches):
            try:
                valid.append((i, batch, self._check(batch)))
            except Exception as exc:  # a bad batch costs its caller, never the service
                log.warning("rejecting batch %d: %s", batch.call_id, exc)
                results[i] = ExpertResult(batch.call_id, error=str(exc))
        if valid:
            start, spans = time.time_ns(), []
            try:
                outputs = self._grouped([b.tokens_per_expert for _, b, _ in valid],
                                        [x for _, _, x in valid], valid[0][1].layer, spans)
                for _, batch, _ in valid:
                    if batch.trace_context:  # sent only by a recording dispatch span
                        self._trace(batch, start, spans)
                for (i, batch, x), y in zip(valid, outputs, strict=True):
                    out = y.to(x.dtype) if x.is_floating_point() else y  # MXFP4 in, float out
                    results[i] = ExpertResult(batch.call_id, to_wire(out))
            except Exception as exc:  # e.g. out of device memory: these calls fail, the
                # service stays (its callers see an expert rank error, a retryable 503)
                log.exception("expert computation failed for layer %d", valid[0][1].layer)
                for i, batch, _ in valid:
                    results[i] = ExpertResult(batch.call_id, error=f"expert computation "
                                                                   f"failed: {root_causes(exc)}")
        return [results[i] for i in range(len(batches))]

    def _trace(self, batch: ExpertBatch, start: int, spans: list[tuple[int, int]]) -> None:
        """The layer's span under the caller's dispatch span, and one span per local expert
        (the GEMM time is shared when batches were coalesced)."""
        tracer, rank = tracing.tracer(), self.config.rank
        layer_span = tracer.start_span(
            f"experts layer {batch.layer}", context=tracing.extract(batch.trace_context),
            start_time=start, attributes={"switchyard.layer": batch.layer,
                                          "switchyard.expert_rank": rank,
                                          "switchyard.tokens": sum(batch.tokens_per_expert)})
        context = set_span_in_context(layer_span)
        experts = self.bank.experts[batch.layer]
        for expert, count, (t0, t1) in zip(experts, batch.tokens_per_expert, spans,
                                           strict=True):
            if count:
                tracer.start_span(f"expert {batch.layer}.{expert}", context=context,
                                  start_time=t0, attributes={
                                      "switchyard.layer": batch.layer,
                                      "switchyard.expert": expert,
                                      "switchyard.expert_rank": rank,
                                      "switchyard.tokens": count,
                                      "switchyard.duration_s": (t1 - t0) / 1e9}).end(t1)
        layer_span.end()

    def _grouped(self, counts: list[list[int]], xs: list[torch.Tensor], layer: int,
                 spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Merge the batches expert by expert, run the FFN once, split the outputs back."""
        n, num_local = len(xs), len(counts[0])
        device = self.bank.device
        pieces = [(x if x.dtype == torch.uint8 else x.to(self.bank.dtype)).to(device).split(c)
                  for x, c in zip(xs, counts, strict=True)]
        merged = torch.cat([pieces[b][e] for e in range(num_local) for b in range(n)])
        totals = [sum(c[e] for c in counts) for e in range(num_local)]
        with torch.inference_mode():
            y = self.bank.forward(layer, merged, totals, spans)
        y_pieces = y.split([counts[b][e] for e in range(num_local) for b in range(n)])
        return [torch.cat([y_pieces[e * n + b] for e in range(num_local)]) for b in range(n)]

    def submit(self, batch: ExpertBatch, conn: FrameStream) -> None:
        self._queue.append((batch, conn))
        self._arrived.set()

    async def run_compute(self) -> None:
        """Coalesce: whatever arrived for the same layer while the last GEMM ran is served
        by the next one, so M attention ranks make one larger expert batch."""
        while True:
            if not self._queue:
                await self._arrived.wait()
                self._arrived = anyio.Event()
                continue
            layer = self._queue[0][0].layer
            todo = [q for q in self._queue if q[0].layer == layer]
            self._queue = [q for q in self._queue if q[0].layer != layer]
            results = await anyio.to_thread.run_sync(self.compute, [b for b, _ in todo])
            self.num_coalesced += len(todo) - 1
            for (_, conn), result in zip(todo, results, strict=True):
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                    await conn.send(result)

    async def handle(self, conn: FrameStream) -> None:
        async def on_message(msg: Message) -> None:
            if isinstance(msg, InfoRequest):
                await conn.send(self.info())
            elif isinstance(msg, ExpertBatch):
                self.submit(msg, conn)
            else:
                log.warning("ignoring unexpected %s", type(msg).__name__)

        await serve_messages(conn, on_message, log)


async def serve(config: ExpertConfig, server: ExpertServer, metrics_port: int | None) -> None:
    listener = await anyio.create_tcp_listener(local_host=config.host, local_port=config.port)
    port = listener.extra(SocketAttribute.local_port)
    log.info("expert rank %d/%d listening on %s:%d, holding %.1f MB", config.rank,
             config.num_ranks, config.host, port, server.bank.nbytes() / 1e6)
    report_ready(config.ready_fd, port, metrics_port)

    async def on_connect(stream: SocketStream) -> None:
        await server.handle(FrameStream(stream))

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_on_signal, tg.cancel_scope)
        tg.start_soon(server.run_compute)
        await listener.serve(on_connect)


def serve_collective(config: ExpertConfig, server: ExpertServer,
                     metrics_port: int | None) -> None:
    """A lockstep backend (torch, nccl, deepep): join the attention ranks' world and serve
    every round, with the backend's own expert side."""
    if config.dist_init is None:
        raise ValueError(f"--dispatch-backend {config.dispatch_backend} needs --dist-init "
                         "HOST:PORT")
    world = World(config.dist_init, config.attention_ranks, config.num_ranks,
                  rank=config.attention_ranks + config.rank)
    bank = server.bank

    def ready() -> None:
        log.info("expert rank %d/%d joined the %s world, holding %.1f MB, moving %s",
                 config.rank, config.num_ranks, config.dispatch_backend, bank.nbytes() / 1e6,
                 bank.rows.describe())
        report_ready(config.ready_fd, 0, metrics_port)

    side = ExpertSide(WorldSettings(world, config.rendezvous_timeout, config.deepep),
                      server.placement, bank.forward, bank.rows, config.device,
                      server.model_config.top_k, ready)
    serve = server.backend.serve
    assert serve is not None  # (every collective backend has an expert side)
    with torch.inference_mode():
        serve(side)


def main(config: ExpertConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s expert %(message)s")
    setup_tracing("switchyard-expert", config.otlp_traces_endpoint)
    try:
        server = ExpertServer(config)
        metrics_port = start_metrics_server(config.host, config.metrics_port)
        if server.backend.collective:
            serve_collective(config, server, metrics_port)
            return 0
    except (CheckpointError, ValueError, OSError, RendezvousError) as exc:
        print(f"switchyard expert: {exc}", file=sys.stderr)
        return 2
    return run_service("expert", config.host, config.port, serve, config, server,
                       metrics_port)
