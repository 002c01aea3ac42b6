"""`ep_dispatch.torch_dist`'s rendezvous, in this process (its ranks as threads): ranks
that would move different rows name each other, and a rendezvous that times out names the
ranks that never came, after the attention rank's own `--rendezvous-timeout`."""

from __future__ import annotations

import pytest
import torch

from common.ports import free_port

pytestmark = pytest.mark.timeout(300)


def test_ranks_that_move_different_rows_name_each_other() -> None:
    """Rows must match on every rank of a lockstep world, or the all-to-alls mis-size."""
    from concurrent.futures import ThreadPoolExecutor

    from ep_dispatch.torch_dist import World, agree, rendezvous
    from ep_dispatch.wire import RowFormat

    rows = [RowFormat(64, torch.float32, "w4a4"), RowFormat(64, torch.float32)]

    def messages(rows: list[RowFormat], transports: list[str]) -> list[str]:
        port = free_port()

        def rank(r: int) -> str:
            world = World(("127.0.0.1", port), num_attention=1, num_experts=1, rank=r)
            store = rendezvous(world, 30)
            with pytest.raises(ValueError) as info:
                agree(store, world, rows[r], 30, transports[r])
            del store  # rank 0 hosts it: every rank must have read before any raises
            return str(info.value)

        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(rank, [0, 1]))

    for message in messages(rows, ["gloo", "gloo"]):
        assert message == (
            "the ranks move different rows (attention rank 0: MXFP4 rows of hidden 64 "
            "(34 bytes), float32 outputs, over gloo; expert rank 0: float32 rows of hidden "
            "64, over gloo): start every rank with the same --quantization, --dtype and "
            "--device")
    # The same rows, but one rank on CUDA (NCCL) and one on the CPU (gloo): never meet.
    for message in messages([rows[1], rows[1]], ["nccl", "gloo"]):
        assert "attention rank 0: float32 rows of hidden 64, over nccl; expert rank 0: " \
            "float32 rows of hidden 64, over gloo" in message


def test_rendezvous_timeout_names_the_missing_ranks() -> None:
    from ep_dispatch.torch_dist import RendezvousError, World, join

    port = free_port()  # this process hosts the store as attention rank 0; nobody else comes
    with pytest.raises(RendezvousError, match=rf"waited 1s at 127\.0\.0\.1:{port} for "
                                              r"expert rank 0, expert rank 1"):
        join(World(("127.0.0.1", port), num_attention=1, num_experts=2, rank=0), timeout=1)


def test_an_attention_rank_waits_its_rendezvous_timeout_not_the_expert_timeout() -> None:
    """Expert ranks load most of the weights before they join: the attention rank's wait
    is `--rendezvous-timeout`, not the 30 s an rpc call may take (`--expert-timeout`)."""
    from ep_dispatch.registry import (
        BackendSettings,
        MoESeam,
        RpcSettings,
        WorldSettings,
        create_experts_client,
    )
    from ep_dispatch.torch_dist import RendezvousError, World

    port = free_port()
    settings = BackendSettings(
        rpc=RpcSettings([], call_timeout=600, connect_timeout=600),
        world=WorldSettings(World(("127.0.0.1", port), 1, 1, rank=0), rendezvous_timeout=1))
    with pytest.raises(RendezvousError, match=r"waited 1s at .* for expert rank 0"):
        create_experts_client("torch", MoESeam([0], 8, hidden_size=8), settings)
