"""The expert service process: an `ExpertBank` behind a `switchyard.rpc` listener.

Any number of attention ranks connect (M:N). Each `ExpertBatch` is computed in a worker
thread, one at a time, and answered on the connection it came from.
"""

from __future__ import annotations

import logging
import os
import sys

import anyio
import torch
from anyio.abc import SocketAttribute, SocketStream

from ep_dispatch.placement import make_placement
from ep_dispatch.torch_dist import RendezvousError, World, join, serve_experts
from ep_dispatch.wire import from_wire, to_wire
from services.attention.config import resolve_dtype
from services.expert.config import ExpertConfig
from services.expert.experts import ExpertBank
from services.model.checkpoint import Checkpoint
from services.model.config import CheckpointError, ModelConfig
from switchyard.messages import ExpertBatch, ExpertInfo, ExpertResult, InfoRequest
from switchyard.rpc import FrameStream

log = logging.getLogger("switchyard.expert")


class ExpertServer:
    def __init__(self, config: ExpertConfig) -> None:
        if not 0 <= config.rank < config.num_ranks:
            raise ValueError(f"--rank {config.rank} is outside 0..{config.num_ranks - 1}")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        model_config = ModelConfig.from_dir(config.model)
        moe_layers = [i for i, is_moe in enumerate(model_config.moe_layers) if is_moe]
        self.placement = make_placement(moe_layers, model_config.num_experts, config.num_ranks,
                                        config.placement)
        checkpoint = Checkpoint(config.model)
        self.bank = ExpertBank(model_config, checkpoint,
                               self.placement.local_experts(config.rank),
                               resolve_dtype(config.dtype, "cpu"))
        checkpoint.close()
        self._compute = anyio.CapacityLimiter(1)

    def info(self) -> ExpertInfo:
        return ExpertInfo(self.config.rank, self.config.num_ranks, self.bank.experts,
                          self.bank.nbytes())

    def compute(self, batch: ExpertBatch) -> ExpertResult:
        try:
            x = from_wire(batch.x)
            if batch.layer not in self.bank.experts:
                raise ValueError(f"layer {batch.layer} is not an MoE layer")
            if len(batch.tokens_per_expert) != len(self.bank.experts[batch.layer]) or \
                    sum(batch.tokens_per_expert) != x.shape[0]:
                raise ValueError("tokens_per_expert does not match this rank's experts")
            with torch.inference_mode():
                y = self.bank.forward(batch.layer, x.to(self.bank.dtype),
                                      batch.tokens_per_expert)
            return ExpertResult(batch.call_id, to_wire(y.to(x.dtype)))
        except Exception as exc:  # a bad batch costs its caller, never the service
            log.warning("rejecting batch %d: %s", batch.call_id, exc)
            return ExpertResult(batch.call_id, error=str(exc))

    async def handle(self, conn: FrameStream) -> None:
        async with anyio.create_task_group() as tg:
            try:
                while True:
                    msg = await conn.receive()
                    if isinstance(msg, InfoRequest):
                        await conn.send(self.info())
                    elif isinstance(msg, ExpertBatch):
                        tg.start_soon(self._answer, conn, msg)
                    else:
                        log.warning("ignoring unexpected %s", type(msg).__name__)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            except Exception:
                log.exception("dropping a connection that sent a bad frame")
            finally:
                tg.cancel_scope.cancel()
                await conn.aclose()

    async def _answer(self, conn: FrameStream, batch: ExpertBatch) -> None:
        result = await anyio.to_thread.run_sync(self.compute, batch, limiter=self._compute)
        await conn.send(result)


async def serve(config: ExpertConfig, server: ExpertServer) -> None:
    from services.attention.server import cancel_on_signal

    listener = await anyio.create_tcp_listener(local_host=config.host, local_port=config.port)
    port = listener.extra(SocketAttribute.local_port)
    log.info("expert rank %d/%d listening on %s:%d, holding %.1f MB", config.rank,
             config.num_ranks, config.host, port, server.bank.nbytes() / 1e6)
    _report_ready(config, port)

    async def on_connect(stream: SocketStream) -> None:
        await server.handle(FrameStream(stream))

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_on_signal, tg.cancel_scope)
        await listener.serve(on_connect)


def _report_ready(config: ExpertConfig, port: int) -> None:
    if config.ready_fd is not None:
        os.write(config.ready_fd, f"{port}\n".encode())
        os.close(config.ready_fd)


def serve_collective(config: ExpertConfig, server: ExpertServer) -> None:
    """torch backend: join the attention ranks' process group and serve every round."""
    if config.dist_init is None:
        raise ValueError("--dispatch-backend torch needs --dist-init HOST:PORT")
    world = World(config.dist_init, config.attention_ranks, config.num_ranks,
                  rank=config.attention_ranks + config.rank)
    join(world, config.rendezvous_timeout)
    log.info("expert rank %d/%d joined the torch world, holding %.1f MB", config.rank,
             config.num_ranks, server.bank.nbytes() / 1e6)
    _report_ready(config, 0)
    with torch.inference_mode():
        serve_experts(world, server.placement, server.bank.forward,
                      server.bank.hidden_size, server.bank.dtype)


def main(config: ExpertConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s expert %(message)s")
    try:
        server = ExpertServer(config)
        if config.dispatch_backend == "torch":
            serve_collective(config, server)
            return 0
    except (CheckpointError, ValueError, OSError, RendezvousError) as exc:
        print(f"switchyard expert: {exc}", file=sys.stderr)
        return 2
    anyio.run(serve, config, server)
    return 0
