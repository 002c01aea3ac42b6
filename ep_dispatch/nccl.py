"""`nccl` backend: the `torch` backend's lockstep exchange, over NCCL through CuPy.

The ranks meet at the same TCP store as the `torch` backend; rank 0 publishes an NCCL
unique id there and every rank builds a `cupy.cuda.nccl.NcclCommunicator` from it. Each
all-to-all is one NCCL group of point-to-point sends and receives of raw bytes, so
w4a4's MXFP4 rows travel as they are.

Every NCCL call of a communicator runs on its own CUDA stream, in the order issued so that
the ranks' calls meet, after whatever the issuing stream had queued. `all_to_all` then
orders the issuing stream after it. `start_all_to_all` returns at once with a work whose
`wait()` does that later. Neither makes the host wait. In a ping-pong pipeline the current
stream computes one micro-batch's attention while the communicator's stream moves
another's rows (`TorchExperts.start`). The host still reads each layer's row counts for the
layout, because NCCL's point-to-point calls take their sizes from the host.

`nccl` needs `--device cuda`. It has run on one H200 at world size 1, not yet across GPUs,
and the overlap of micro-batches has not yet run on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgspec
import torch

from common.messages import NcclUniqueId
from ep_dispatch.torch_dist import World, agree, rendezvous
from ep_dispatch.wire import RowFormat

_UID_KEY = "switchyard/nccl_unique_id"


def import_nccl() -> Any:
    """`cupy.cuda.nccl`, or an error that says how to install it."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ValueError("the nccl dispatch backend needs CuPy with NCCL: pip install "
                         "cupy-cuda12x (scripts/bootstrap.sh gpu installs it)") from exc
    return nccl


def encode_unique_id(uid: bytes | tuple[int, ...]) -> bytes:
    """NCCL's 128-byte unique id for the store: CuPy 14 gives and takes `bytes`, CuPy 13
    a tuple of signed chars."""
    return msgspec.msgpack.encode(NcclUniqueId(list(uid), isinstance(uid, bytes)))


def decode_unique_id(data: bytes) -> bytes | tuple[int, ...]:
    uid = msgspec.msgpack.decode(data, type=NcclUniqueId)
    return bytes(uid.id) if uid.as_bytes else tuple(uid.id)


def p2p_plan(out_splits: list[int], in_splits: list[int], row_bytes: int
             ) -> list[tuple[int, int, int, int, int]]:
    """Per peer with anything to move: (peer, send offset, send bytes, receive offset,
    receive bytes), offsets in bytes into the flat input and output buffers."""
    plan, send_at, recv_at = [], 0, 0
    for peer, (n_out, n_in) in enumerate(zip(out_splits, in_splits, strict=True)):
        if n_out or n_in:
            plan.append((peer, send_at, n_in * row_bytes, recv_at, n_out * row_bytes))
        send_at += n_in * row_bytes
        recv_at += n_out * row_bytes
    return plan


class StreamWork:
    """NCCL calls in flight on a communicator's stream. `wait()` orders the current CUDA
    stream after them; the host does not wait."""

    def __init__(self, done: torch.cuda.Event) -> None:
        self.done = done

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.done)


class CupyNccl:
    """The `Collective` of torch_dist over a CuPy NCCL communicator, for CUDA tensors only."""

    def __init__(self, world: World, timeout: float, rows: RowFormat | None = None) -> None:
        self.nccl = import_nccl()
        self.size = world.size
        self._store = rendezvous(world, timeout)  # rank 0 hosts it: keep it alive
        if rows is not None:  # every rank must move the same rows
            agree(self._store, world, rows, timeout, "NCCL (CuPy)")
        if world.rank == 0:
            self._store.set(_UID_KEY, encode_unique_id(self.nccl.get_unique_id()))
        self._store.wait([_UID_KEY], timedelta(seconds=timeout))
        uid = decode_unique_id(self._store.get(_UID_KEY))
        self.comm = self.nccl.NcclCommunicator(world.size, uid, world.rank)
        self._stream: torch.cuda.Stream | None = None  # made on first use, on the rank's GPU

    def _issue(self, tensors: list[torch.Tensor], calls: Callable[[int], None]
               ) -> StreamWork:
        """`calls(stream)` on the communicator's stream, after the current stream's queued
        work. `tensors`, those the calls read or write, are kept from the allocator until
        the communicator's stream is past them."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        calls(side.cuda_stream)
        for t in tensors:
            t.record_stream(side)
        done = torch.cuda.Event()
        done.record(side)
        return StreamWork(done)

    def agree_rounds(self, rounds: int, device: torch.device) -> int:
        most = torch.tensor([rounds], dtype=torch.int32, device=device)
        self._issue([most], lambda stream: self.comm.allReduce(
            most.data_ptr(), most.data_ptr(), 1, self.nccl.NCCL_INT32, self.nccl.NCCL_MAX,
            stream)).wait()
        return int(most.item())

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor,
                   out_splits: list[int] | None = None,
                   in_splits: list[int] | None = None) -> None:
        self.start_all_to_all(out, inp, out_splits, in_splits).wait()

    def start_all_to_all(self, out: torch.Tensor, inp: torch.Tensor,
                         out_splits: list[int] | None = None,
                         in_splits: list[int] | None = None) -> StreamWork:
        """`all_to_all` issued on the communicator's stream. The returned work's `wait()`
        orders the current stream after it."""
        out_splits = out_splits or [out.shape[0] // self.size] * self.size
        in_splits = in_splits or [inp.shape[0] // self.size] * self.size
        row = max(out[0].numel() if out.shape[0] else 0,
                  inp[0].numel() if inp.shape[0] else 0) * inp.element_size()
        inp = inp.contiguous()
        plan, nccl = p2p_plan(out_splits, in_splits, row), self.nccl

        def calls(stream: int) -> None:
            nccl.groupStart()
            for peer, send_at, send, recv_at, recv in plan:
                if send:
                    self.comm.send(inp.data_ptr() + send_at, send, nccl.NCCL_UINT8, peer,
                                   stream)
                if recv:
                    self.comm.recv(out.data_ptr() + recv_at, recv, nccl.NCCL_UINT8, peer,
                                   stream)
            nccl.groupEnd()

        return self._issue([out, inp], calls)

    def ready(self) -> bool:
        return True  # a dead rank shows as an error at the next collective

    def close(self) -> None:
        self.comm.destroy()
