"""The `nccl` backend on a CPU machine: its start-up errors, its all-to-all plan, the
unique id across the store, and its metrics' backend label."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def test_nccl_backend_needs_cuda_and_names_cupy() -> None:
    from ep_dispatch.registry import MoESeam, backend, create_experts_client

    with pytest.raises(ValueError, match="moves CUDA tensors: run the services with "
                                         "--device cuda"):
        backend("nccl", "cpu")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs CuPy with NCCL: pip install cupy-cuda12x"):
            create_experts_client("nccl", MoESeam([0], 8, device="cuda"))


def test_nccl_all_to_all_plan() -> None:
    """Byte offsets of the grouped sends and receives, as all_to_all_single's splits."""
    from ep_dispatch.nccl import p2p_plan

    # 3 ranks, 8-byte rows: send 2 rows to rank 0, none to 1, 1 to 2; receive 0, 3, 1.
    assert p2p_plan([0, 3, 1], [2, 0, 1], 8) == [
        (0, 0, 16, 0, 0), (1, 16, 0, 0, 24), (2, 16, 8, 24, 8)]
    assert p2p_plan([0, 0], [0, 0], 8) == []


@pytest.mark.parametrize("uid", [bytes(range(128)),  # CuPy 14: bytes
                                 tuple(range(-64, 64))])  # CuPy 13: signed chars
def test_nccl_unique_id_crosses_the_store_in_the_type_cupy_gave(uid: bytes | tuple) -> None:
    import datetime

    import torch.distributed as dist

    from ep_dispatch.nccl import decode_unique_id, encode_unique_id

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    store.set("uid", encode_unique_id(uid))
    back = decode_unique_id(store.get("uid"))
    assert back == uid and type(back) is type(uid)


def test_the_nccl_backend_reports_its_metrics_as_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """It reuses the torch backend's exchange: its dispatch and combine histograms must
    still say `backend="nccl"` (the docs and dashboard name it so)."""
    from ep_dispatch import nccl
    from ep_dispatch.registry import (
        BackendSettings,
        MoESeam,
        WorldSettings,
        create_experts_client,
    )
    from ep_dispatch.torch_dist import World

    monkeypatch.setattr(nccl, "import_nccl", lambda: None)
    monkeypatch.setattr(nccl, "CupyNccl", lambda *args: "communicator")
    world = World(("127.0.0.1", 1), 1, 1, rank=0)
    client = create_experts_client("nccl", MoESeam([0], 8, device="cuda"),
                                   BackendSettings(world=WorldSettings(world)))
    assert (client.backend, client.coll) == ("nccl", "communicator")  # type: ignore[attr-defined]


def test_every_nccl_call_runs_on_the_communicators_stream_after_the_current_ones_work(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The order a GPU needs, recorded through stand-ins for CUDA's streams and events and
    CuPy's communicator (no GPU here): the communicator's stream waits for the current
    one, then gets every NCCL call (one stream: the ranks' calls meet in the order
    issued), then an event; `wait()` orders the current stream after that event, so
    `start_all_to_all` returns without the host or the current stream waiting."""
    import torch

    from ep_dispatch import nccl

    log: list[tuple] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name, self.cuda_stream = name, f"<{name}>"

        def wait_stream(self, other: Stream) -> None:
            log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event: Event) -> None:
            log.append(("wait_event", self.name, event.n))

    class Event:
        made = 0

        def __init__(self) -> None:
            Event.made += 1
            self.n = Event.made

        def record(self, stream: Stream) -> None:
            log.append(("record", self.n, stream.name))

    class Comm:
        def __getattr__(self, call: str) -> Callable[..., None]:  # send, recv, allReduce:
            # (..., stream) last
            return lambda *args: log.append((call, args[-1]))

    class Nccl:
        NCCL_UINT8 = NCCL_INT32 = NCCL_MAX = 0

        def groupStart(self) -> None:
            log.append(("groupStart",))

        def groupEnd(self) -> None:
            log.append(("groupEnd",))

    current = Stream("current")
    monkeypatch.setattr(torch.cuda, "Stream", lambda: Stream("comm"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, s: log.append(("record_stream", tuple(t.shape), s.name)))
    coll = object.__new__(nccl.CupyNccl)
    coll.nccl, coll.comm, coll.size, coll._stream = Nccl(), Comm(), 2, None

    out, inp = torch.zeros(3, 4), torch.ones(5, 4)
    work = coll.start_all_to_all(out, inp, [1, 2], [4, 1])
    assert log == [("wait_stream", "comm", "current"), ("groupStart",),
                   ("send", "<comm>"), ("recv", "<comm>"), ("send", "<comm>"),
                   ("recv", "<comm>"), ("groupEnd",), ("record_stream", (3, 4), "comm"),
                   ("record_stream", (5, 4), "comm"), ("record", 1, "comm")]
    log.clear()
    work.wait()
    assert log == [("wait_event", "current", 1)]
    log.clear()
    coll.all_to_all(out, inp, [1, 2], [4, 1])  # the same, waited on at once
    assert log[0] == ("wait_stream", "comm", "current") and \
        log[-2:] == [("record", 2, "comm"), ("wait_event", "current", 2)]
    log.clear()
    assert coll.agree_rounds(3, torch.device("cpu")) == 3  # one rank: the max is its own
    assert log == [("wait_stream", "comm", "current"), ("allReduce", "<comm>"),
                   ("record_stream", (1,), "comm"), ("record", 3, "comm"),
                   ("wait_event", "current", 3)]
