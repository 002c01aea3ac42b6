"""Shared fixtures: tiny transformers-built checkpoints (the oracle) and engines over them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import checkpoints


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("qwen3")
    return path, checkpoints.build(checkpoints.qwen3_moe_config(), path, seed=1)


@pytest.fixture(scope="session")
def mixtral_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("mixtral")
    # Sharded with an index file, to cover that loading path.
    return path, checkpoints.build(checkpoints.mixtral_config(), path, seed=2,
                                   max_shard_size="200KB")


@pytest.fixture(params=["qwen3", "mixtral"])
def ckpt(request: pytest.FixtureRequest) -> tuple[Path, object]:
    return request.getfixturevalue(f"{request.param}_ckpt")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped, saying so, where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
