"""The `nccl` backend on a CPU machine: its start-up errors, its all-to-all plan, the
unique id across the store, and its metrics' backend label."""

from __future__ import annotations

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
