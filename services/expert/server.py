"""The expert service process: an `ExpertBank`, served by its dispatch backend's expert
side. With `rpc` that is a TCP listener any number of attention ranks connect to, with
`ExpertServer.compute` answering each layer's batches. With the lockstep backends it is their
world's rounds.

A rebalance's new placement is loaded on a thread of its own, one version at a time, while
the computation answers layer calls (`ExpertServer.prepare`, `ExpertBank.moved_to`). A layer
whose experts on this rank do not change shares the tensors it has. A changed layer is read
from the checkpoint, one layer after another; W4A4 experts are read with their scales, as at
start-up. The rank keeps the newest version and every version a connection still uses. A
connection says which version it uses on connecting, with each switch, and by each batch.
The other versions are freed as the last connection moves on or closes.

Before it computes, the service checks every field of a batch that indexes memory: its
layer, its placement version, and its counts against its rows and bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time

import torch
from opentelemetry.trace import set_span_in_context

from common import tracing
from common.auth import check_listen
from common.device import check_device, resolve_dtype
from common.failures import root_causes
from common.messages import (
    ExpertBatch,
    ExpertInfo,
    ExpertResult,
    PlacementReady,
    PlacementUpdate,
)
from common.metrics import report_ready, start_metrics_server
from common.tracing import setup_tracing
from ep_dispatch.placement import Placement, make_placement
from ep_dispatch.registry import ExpertSide, WorldSettings, backend
from ep_dispatch.rpc_server import RpcListen
from ep_dispatch.torch_dist import RendezvousError, World
from ep_dispatch.wire import from_wire, to_wire
from moe_kernels.cpu_kernels import release_threads
from services.expert.config import ExpertConfig
from services.model.checkpoint import Checkpoint
from services.model.config import CheckpointError, ModelConfig
from services.model.experts import ExpertBank

log = logging.getLogger("switchyard.expert")


class ExpertServer:
    """One expert rank: its placement's share of every MoE layer's experts, loaded. Each
    layer's batches are checked and answered with one grouped GEMM (`compute`).

    A rebalance (`prepare`) loads the share of a new placement version beside the ones
    served, sharing the layers whose experts stay. Each batch names the version it was laid
    out by. A version older than the newest is freed once no connection uses it
    (`release`)."""

    def __init__(self, config: ExpertConfig) -> None:
        if not 0 <= config.rank < config.num_ranks:
            raise ValueError(f"--rank {config.rank} is outside 0..{config.num_ranks - 1}")
        check_device(config.device, "expert")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = model_config = ModelConfig.from_dir(config.model)
        self.moe_layers = moe_layers = model_config.served_moe_layers(
            backend(config.dispatch_backend).mtp)
        self.placement = make_placement(moe_layers, model_config.num_experts, config.num_ranks,
                                        config.placement, config.expert_replicas)
        checkpoint = Checkpoint(config.model)
        bank = ExpertBank(model_config, checkpoint, self.placement.local_experts(config.rank),
                          resolve_dtype(config.dtype, config.device), config.quantization,
                          config.rank, config.device)
        checkpoint.close()
        self.versions: dict[int, ExpertBank] = {0: bank}  # placement version -> its share
        self.backend = backend(config.dispatch_backend, config.device, bank.quantization)

    @property
    def bank(self) -> ExpertBank:
        """The newest placement's share."""
        versions = dict(self.versions)  # a copy, as `release` runs on another thread
        return versions[max(versions)]

    def info(self) -> ExpertInfo:
        bank = self.bank
        return ExpertInfo(self.config.rank, self.config.num_ranks, bank.experts, bank.nbytes(),
                          bank.quantization,
                          shares={v: b.experts for v, b in dict(self.versions).items()})

    def prepare(self, update: PlacementUpdate) -> PlacementReady:
        """Load this rank's share of placement `update.version` beside the ones served.
        The layers whose experts change are read from the checkpoint, and the others are
        shared. This blocks, so it runs off the event loop and the computation, one at a
        time."""
        rank, version = self.config.rank, update.version
        if (bank := self.versions.get(version)) is not None:
            return PlacementReady(version, rank, bank.experts, bank.nbytes())
        try:
            if version <= (newest := max(list(self.versions))):
                raise ValueError(f"placement version {version} is older than the newest "
                                 f"held here ({newest})")
            cfg = self.model_config
            placement = Placement.from_json(update.placement, self.moe_layers,
                                            cfg.num_experts, f"placement version {version}")
            if placement.num_ranks != self.config.num_ranks:
                raise ValueError(f"placement version {version} places experts on "
                                 f"{placement.num_ranks} ranks, not {self.config.num_ranks}")
            start = time.monotonic()
            _yield_to_computation()
            log.info("loading placement version %d's share ...", version)
            checkpoint = Checkpoint(self.config.model)
            try:
                bank = self.bank.moved_to(placement.local_experts(rank), checkpoint, _progress)
            finally:
                checkpoint.close()
            load_s = time.monotonic() - start
        except Exception as exc:  # a bad placement or a failed read: the old ones serve on
            log.warning("cannot load placement version %d: %s", version, root_causes(exc))
            return PlacementReady(version, rank, error=root_causes(exc))
        self.versions[version] = bank
        log.info("placement version %d loaded in %.2f s: %.1f MB", version, load_s,
                 bank.nbytes() / 1e6)
        return PlacementReady(version, rank, bank.experts, bank.nbytes(), load_s)

    def release(self, in_use: set[int]) -> None:
        """Free every placement older than the newest that no connection uses."""
        held = list(self.versions)  # a copy, as a load may add one meanwhile
        newest = max(held)
        for version in [v for v in held if v != newest and v not in in_use]:
            del self.versions[version]
            log.info("placement version %d freed: no connection routes by it", version)

    def _check(self, batch: ExpertBatch) -> tuple[ExpertBank, torch.Tensor]:
        """The batch's rows [N, width] and the share they were laid out for."""
        x = from_wire(batch.x)
        bank = self.versions.get(batch.version)
        if bank is None:
            raise ValueError(f"placement version {batch.version} is not held here (held: "
                             f"{sorted(self.versions)})")
        if batch.layer not in bank.experts:
            raise ValueError(f"layer {batch.layer} is not an MoE layer")
        if len(batch.tokens_per_expert) != len(bank.experts[batch.layer]) or \
                min(batch.tokens_per_expert, default=0) < 0 or \
                sum(batch.tokens_per_expert) != x.shape[0] or x.ndim != 2 or \
                x.shape[1] != bank.rows.width or \
                (x.dtype == torch.uint8) != (bank.quantization == "w4a4"):
            raise ValueError("the batch does not match this rank's experts or hidden size")
        return bank, x

    def compute(self, batches: list[ExpertBatch]) -> list[ExpertResult]:
        """Answer batches of one layer and placement version, from any attention ranks,
        with one grouped GEMM."""
        results: dict[int, ExpertResult] = {}
        valid: list[tuple[int, ExpertBatch, torch.Tensor]] = []
        bank = None
        for i, batch in enumerate(batches):
            try:
                bank, x = self._check(batch)
                valid.append((i, batch, x))
            except Exception as exc:  # a bad batch costs its caller, never the service
                log.warning("rejecting batch %d: %s", batch.call_id, exc)
                results[i] = ExpertResult(batch.call_id, error=str(exc))
        if valid:
            assert bank is not None  # the batches' version
            start, spans = time.time_ns(), []
            try:
                outputs = self._grouped(bank, [b.tokens_per_expert for _, b, _ in valid],
                                        [x for _, _, x in valid], valid[0][1].layer, spans)
                for _, batch, _ in valid:
                    if batch.trace_context:  # sent only by a recording dispatch span
                        self._trace(bank, batch, start, spans)
                for (i, batch, x), y in zip(valid, outputs, strict=True):
                    out = y.to(x.dtype) if x.is_floating_point() else y  # MXFP4 in, float out
                    results[i] = ExpertResult(batch.call_id, to_wire(out))
            except Exception as exc:  # e.g. out of device memory: these calls fail, but the
                # service stays; its callers see an expert rank error, a retryable 503
                log.exception("expert computation failed for layer %d", valid[0][1].layer)
                for i, batch, _ in valid:
                    results[i] = ExpertResult(batch.call_id, error=f"expert computation "
                                                                   f"failed: {root_causes(exc)}")
        return [results[i] for i in range(len(batches))]

    def _trace(self, bank: ExpertBank, batch: ExpertBatch, start: int,
               spans: list[tuple[int, int]]) -> None:
        """The layer's span under the caller's dispatch span, and one span per local
        expert. The GEMM time is shared when batches were coalesced."""
        tracer, rank = tracing.tracer(), self.config.rank
        layer_span = tracer.start_span(
            f"experts layer {batch.layer}", context=tracing.extract(batch.trace_context),
            start_time=start, attributes={"switchyard.layer": batch.layer,
                                          "switchyard.expert_rank": rank,
                                          "switchyard.tokens": sum(batch.tokens_per_expert)})
        context = set_span_in_context(layer_span)
        experts = bank.experts[batch.layer]
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

    def _grouped(self, bank: ExpertBank, counts: list[list[int]], xs: list[torch.Tensor],
                 layer: int, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Merge the batches expert by expert, run the FFN once, split the outputs back."""
        n, num_local = len(xs), len(counts[0])
        device = bank.device
        pieces = [(x if x.dtype == torch.uint8 else x.to(bank.dtype)).to(device).split(c)
                  for x, c in zip(xs, counts, strict=True)]
        merged = torch.cat([pieces[b][e] for e in range(num_local) for b in range(n)])
        totals = [sum(c[e] for c in counts) for e in range(num_local)]
        with torch.inference_mode():
            y = bank.forward(layer, merged, totals, spans)
        y_pieces = y.split([counts[b][e] for e in range(num_local) for b in range(n)])
        return [torch.cat([y_pieces[e * n + b] for e in range(num_local)]) for b in range(n)]

    def side(self, metrics_port: int | None) -> ExpertSide:
        """What the backend's expert side serves with. Its `ready` reports the rank ready
        to the launcher's pipe once it listens or has joined its world."""
        config, bank = self.config, self.bank

        def ready(port: int) -> None:
            where = f"listening on {config.host}:{port}" if port else \
                f"joined the {config.dispatch_backend} world"
            log.info("expert rank %d/%d %s, holding %.1f MB, moving %s", config.rank,
                     config.num_ranks, where, bank.nbytes() / 1e6, bank.rows.describe())
            report_ready(config.ready_fd, port, metrics_port)

        world = None if config.dist_init is None else WorldSettings(
            World(config.dist_init, config.attention_ranks, config.num_ranks,
                  rank=config.attention_ranks + config.rank),
            config.rendezvous_timeout, config.deepep)
        return ExpertSide(self.placement, bank.forward, bank.rows, config.device,
                          self.model_config.top_k, ready, world,
                          RpcListen(config.host, config.port, self.compute, self.info,
                                    self.prepare, self.release, config.secret,
                                    config.link_timeout))


def _yield_to_computation() -> None:
    """Give this loading thread the lowest CPU priority, so that the layer calls, and the
    other services on these cores, run first. A load takes longer, but a step does not
    wait for it. This works on Linux only, where a thread's niceness is its own; threads it
    starts, such as its OpenMP team, inherit it."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _progress(done: int, total: int) -> None:
    if done == total or done % max(1, total // 4) == 0:
        log.info("  %d/%d layers moved", done, total)


def main(config: ExpertConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s expert %(message)s")
    setup_tracing("switchyard-expert", config.otlp_traces_endpoint)
    try:
        check_listen(config.host, config.secret)
        server = ExpertServer(config)
        release_threads()  # the loading thread's OpenMP team (`common.compute`)
        metrics_port = start_metrics_server(config.host, config.metrics_port, "expert",
                                            config.rank)
        serve = server.backend.serve
        assert serve is not None  # the expert flags offer only backends with an expert side
        with torch.inference_mode():
            serve(server.side(metrics_port))
    except (CheckpointError, ValueError, OSError, RendezvousError) as exc:
        print(f"switchyard expert: {exc}", file=sys.stderr)
        return 2
    return 0
