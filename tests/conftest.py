"""Shared fixtures: tiny transformers-built checkpoints (the oracle) and engines over them."""

from __future__ import annotations

from collections import Counter
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


# Qwen2-MoE and the DeepSeek family: name -> (config builder, its overrides)
FAMILIES = {
    "qwen2_moe": ("qwen2_moe_config", {}),
    "deepseek_v2": ("deepseek_v2_config", {}),  # no q_lora_rank, greedy softmax routing
    "deepseek_v2_grouped": ("deepseek_v2_config", dict(
        topk_method="group_limited_greedy", n_group=4, topk_group=2, q_lora_rank=16,
        routed_scaling_factor=1.5)),
    "deepseek_v3": ("deepseek_v3_config", {}),  # q_lora_rank, 4 groups of which 2 compete
    "deepseek_v3_yarn": ("deepseek_v3_config", dict(  # YaRN, rotate-half rotary, 2 groups
        q_lora_rank=None, n_group=2, topk_group=1, num_experts_per_tok=2,
        rope_interleave=False, max_position_embeddings=512, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0,
            original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=0.707,
            beta_fast=32, beta_slow=1))),
}


def _family_fixture(name: str) -> object:
    builder, overrides = FAMILIES[name]

    @pytest.fixture(scope="session", name=f"{name}_ckpt")
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
        path = tmp_path_factory.mktemp(name)
        config = getattr(checkpoints, builder)(**overrides)
        return path, checkpoints.build(config, path, seed=len(name))

    return fixture


for _name in FAMILIES:
    globals()[f"{_name}_ckpt"] = _family_fixture(_name)


@pytest.fixture(scope="session")
def deepseek_v3_mtp_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, object]:
    """A random DeepSeek-V3 with a random MTP layer after its decoder's: (path, the
    transformers model, the MTP module)."""
    path = tmp_path_factory.mktemp("deepseek_v3_mtp")
    return path, *checkpoints.build_with_mtp(checkpoints.deepseek_v3_config(), path, seed=3)


@pytest.fixture(params=list(FAMILIES))
def family_ckpt(request: pytest.FixtureRequest) -> tuple[Path, object]:
    return request.getfixturevalue(f"{request.param}_ckpt")


@pytest.fixture(params=["qwen3", "mixtral", *FAMILIES])
def every_ckpt(request: pytest.FixtureRequest) -> tuple[Path, object]:
    """Every architecture's checkpoint: Qwen3-MoE, Mixtral and the FAMILIES."""
    return request.getfixturevalue(f"{request.param}_ckpt")


@pytest.fixture(params=["qwen3", "mixtral"])
def ckpt(request: pytest.FixtureRequest) -> tuple[Path, object]:
    return request.getfixturevalue(f"{request.param}_ckpt")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The heaviest files first (`_heaviest_first`); tests marked `gpu` are skipped, saying
    so, where torch sees no CUDA device."""
    _heaviest_first(items)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU: torch.cuda.is_available() is False")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _heaviest_first(items: list[pytest.Item]) -> None:
    """The files that start service processes (tests/e2e) first, then the rest; in each,
    the files with more tests first. scripts/test runs files in this order (xdist's
    `--dist loadfile --no-loadscope-reorder`), each taken by the next worker to free: a
    long file taken last leaves the others idle. xdist's own order, by the number of tests
    alone, put the failover and Docker files (a few tests, minutes each) at the end."""
    counts = Counter(item.path for item in items)
    items.sort(key=lambda item: ("e2e" not in item.path.parts, -counts[item.path],
                                 str(item.path)))
