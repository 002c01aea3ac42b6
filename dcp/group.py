"""The collectives of one DCP attention group, over torch.distributed: gloo on the CPU,
NCCL on a GPU.

The leader (rank 0) schedules and broadcasts each step's plan. Every rank runs the dense
model on all the step's tokens and attends over its own keys, and the partial results are
merged by log-sum-exp. Only the leader dispatches to the experts. It broadcasts the MoE
outputs, so expert services never see a token twice.

Every rank is loaded once the leader's first heartbeat, sent at the end of its build, is
answered. From then on each collective times out after `collective_timeout`, which is
`--expert-timeout` + `--link-timeout` + 5 s, past any hold of a step for a lost expert rank.
An idle leader sends a heartbeat plan every second, which every rank answers with a
one-element all-reduce. So a rank behind a cut link is found on both ends, and the group
exits to be started again whole. A dead rank, leader or peer, makes `serve` kill the
group's other ranks and start them all again, since their rendezvous needs every rank.
Recovery takes about 4-5 s here.
"""

from __future__ import annotations

import datetime
from typing import Protocol

import msgspec
import torch
import torch.distributed as dist

from common.messages import DcpPlan
from dcp.batch import StepBatch
from dcp.merge import merge
from ep_dispatch.base import Done, Exchange, ExpertsClient, Pipelined, PointToPoint
from ep_dispatch.wire import tensor_bytes

# Until the group serves (`DcpGroup.serve`), and always without a collective timeout,
# peers wait in a broadcast as long as the leader loads or idles: no bound short of a year.
_FOREVER = datetime.timedelta(days=365)
HEARTBEAT_S = 1.0  # an idle leader's heartbeat: the peers' wait for a plan stays short
HOLD_MARGIN_S = 5.0  # beyond the longest a peer waits while the leader holds a step


def collective_timeout(expert_timeout: float, link_timeout: float) -> float | None:
    """How long a rank waits in one of the group's collectives before the group counts as
    broken. It is longer than the leader may hold a step for a lost expert rank, which is
    found within `link_timeout` and then waited for up to `expert_timeout`, so a hold never
    breaks the group. It is None, no bound, where liveness is off (`--link-timeout 0`)."""
    if link_timeout <= 0:
        return None
    return expert_timeout + link_timeout + HOLD_MARGIN_S


class PartialAttention(Protocol):
    """A rank's KV cache as the group attends over it (`KVCache`)."""

    def attend_partial(self, layer: int, q: torch.Tensor, batch: StepBatch
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [T, heads, D], lse [T, heads] float32) over the keys this rank holds."""
        ...


class DcpGroup:
    def __init__(self, init: tuple[str, int], rank: int, size: int, backend: str = "gloo",
                 timeout: float = 300.0, op_timeout: float | None = None) -> None:
        """Meet the group's other ranks at rank 0's store, waiting `timeout` seconds. Once
        the group serves (`serve`), a collective fails after `op_timeout` seconds
        (`collective_timeout`); None means never."""
        host, port = init
        store = dist.TCPStore(host, port, size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=_FOREVER)
        self._op_timeout = _FOREVER if op_timeout is None else \
            datetime.timedelta(seconds=op_timeout)
        self._wait = _FOREVER  # loading: a rank may take minutes before its first step
        self.rank, self.size = rank, size
        self._device = "cuda" if backend == "nccl" else "cpu"  # where NCCL/gloo want tensors
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(DcpPlan)

    def _done(self, work: dist.Work | None) -> None:
        """Wait for a collective started with `async_op=True`. Past the bound this raises
        a RuntimeError."""
        assert work is not None
        work.wait(self._wait)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's."""
        self._done(dist.broadcast(tensor, src=0, async_op=True))

    def serve(self) -> None:
        """Every rank is loaded and met, as the first heartbeat was answered. From now on
        each collective is bounded by the collective timeout."""
        self._wait = self._op_timeout

    def send_plan(self, plan: DcpPlan) -> None:
        data = torch.frombuffer(bytearray(self._encoder.encode(plan)), dtype=torch.uint8)
        self.broadcast(torch.tensor([data.numel()], device=self._device))
        self.broadcast(data.to(self._device))

    def heartbeat(self) -> None:
        """On the leader: a heartbeat plan, then a collective every rank joins, the peers
        by `answer_heartbeat`, so the leader too finds a silent peer. The first heartbeat,
        once the leader is loaded, waits for every peer to be loaded, and the group then
        serves."""
        self.send_plan(DcpPlan([], heartbeat=True))
        self.answer_heartbeat()

    def answer_heartbeat(self) -> None:
        self._done(dist.all_reduce(torch.zeros(1, device=self._device), async_op=True))
        self.serve()

    def receive_plan(self) -> DcpPlan:
        size = torch.zeros(1, dtype=torch.int64, device=self._device)
        self.broadcast(size)
        data = torch.empty(int(size), dtype=torch.uint8, device=self._device)
        self.broadcast(data)
        return self._decoder.decode(tensor_bytes(data))

    def attend(self, kv: PartialAttention, layer: int, q: torch.Tensor, batch: StepBatch
               ) -> torch.Tensor:
        """Attention over the whole group's keys: local partials, gathered and merged."""
        out, lse = kv.attend_partial(layer, q, batch)  # [T, H, D], [T, H]
        outs = [torch.empty_like(out) for _ in range(self.size)]
        lses = [torch.empty_like(lse) for _ in range(self.size)]
        self._done(dist.all_gather(outs, out, async_op=True))
        self._done(dist.all_gather(lses, lse, async_op=True))
        return merge(torch.stack(outs), torch.stack(lses))[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class StepAborted(RuntimeError):
    """The leader's expert call failed mid-step because an expert rank was lost, and every
    rank of the group knows it. The peers drop the step and wait for the next plan. The
    leader, which raises it from the failure, fails the step's sequences. The group stays in
    step."""


class GroupExperts(PointToPoint):
    """The MoE seam of a DCP rank. The leader calls the real experts client and broadcasts
    the outputs; peers receive them (`GroupExchange`)."""

    def __init__(self, group: DcpGroup, inner: ExpertsClient | None) -> None:
        self.group, self.inner = group, inner

    def begin_step(self, num_tokens: int, micro_batches: int = 1) -> bool:
        return self.inner.begin_step(num_tokens, micro_batches) if self.inner \
            else num_tokens > 0

    @property
    def overlaps(self) -> bool:
        """The leader pipelines where its experts client does; a peer runs whatever split
        the leader's plan names."""
        return self.inner is None or (isinstance(self.inner, Pipelined)
                                      and self.inner.overlaps)

    def round_trip_s(self) -> float | None:
        return self.inner.round_trip_s() if isinstance(self.inner, Pipelined) else None

    def __call__(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        return self.start(layer, x, topk_ids, topk_weights).finish()

    def start(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor) -> GroupExchange:
        """The leader's call started, by `inner.start`, or the whole call where the client
        cannot start one. The broadcast to the peers, and a peer's receive, happen in
        `finish`, in the order the exchanges started on every rank of the group."""
        if self.inner is None:  # a peer
            return GroupExchange(self.group, layer, x, None)
        inner = self.inner
        try:
            return GroupExchange(self.group, layer, x,
                                 inner.start(layer, x, topk_ids, topk_weights)
                                 if isinstance(inner, Pipelined)
                                 else Done(inner(layer, x, topk_ids, topk_weights)))
        except Exception as exc:  # failed to start: the peers still get this call's status
            return GroupExchange(self.group, layer, x, Failed(exc))

    def describe(self) -> list[str]:
        return self.inner.describe() if self.inner else []

    def ready(self) -> bool:
        return self.inner.ready() if self.inner else True

    def close(self) -> None:
        if self.inner:
            self.inner.close()


class Failed:
    """An exchange that could not start: `finish` raises what stopped it."""

    held_s = 0.0

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def finish(self) -> torch.Tensor:
        raise self.exc


class GroupExchange:
    """One MoE call of a DCP group in flight. The leader finishes its experts' exchange
    (`inner`) and broadcasts the outputs with one more row, the call's status. A peer,
    whose `inner` is None, receives them. A failed call reaches the peers as `StepAborted`.
    Otherwise they would be left waiting for outputs while the leader moves on, and its
    next broadcast would be misread."""

    def __init__(self, group: DcpGroup, layer: int, x: torch.Tensor, inner: Exchange | None
                 ) -> None:
        self.group, self.layer, self.x, self.inner = group, layer, x, inner

    @property
    def held_s(self) -> float:
        return self.inner.held_s if self.inner else 0.0

    def finish(self) -> torch.Tensor:
        x = self.x
        out = torch.empty(x.shape[0] + 1, x.shape[1], dtype=x.dtype, device=x.device)
        if self.inner is None:  # a peer
            self.group.broadcast(out)  # [T + 1, H]
            # a host read per layer: the peer waits for the leader's experts here anyway
            if out[-1, 0].item() != 1:
                raise StepAborted(f"the leader's expert call failed on layer {self.layer}")
            return out[:-1]
        try:
            out[:-1] = self.inner.finish()  # [T, H]
        except BaseException as exc:
            out[-1] = 0
            self.group.broadcast(out)
            if isinstance(exc, Exception):  # DCP's experts are never lockstep ones
                raise StepAborted(str(exc)) from exc  # told the peers: still in step
            raise
        out[-1] = 1
        self.group.broadcast(out)
        return out[:-1]
