"""Tuned W4A4 kernel configs (`moe_kernels.kernel_configs`): the bundled files, the lookup,
bad files, and the sweep's choice (`benchmarks.gpu_mxfp4.best_configs`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu_mxfp4 import best_configs, best_per_shape
from moe_kernels.kernel_configs import (
    CONFIG_DIR,
    KernelConfig,
    config_path,
    load_configs,
    pick,
    tuned_config,
    write_configs,
)
from tests.support import ROOT


@pytest.fixture(autouse=True)
def fresh_cache() -> None:
    load_configs.cache_clear()


def test_every_bundled_file_loads_for_its_device() -> None:
    files = sorted(CONFIG_DIR.glob("*.json"))
    assert files, "no tuned configs are bundled"
    for path in files:
        device = json.loads(path.read_text())["device"]
        assert config_path(device) == path
        configs = load_configs(device)
        assert configs and all(isinstance(c, KernelConfig) for c in configs.values())


def test_the_h200_table_is_the_run_3_sweep_best() -> None:
    """The bundled H200 file is what `best_configs` makes of the committed sweep timings."""
    sweep = ROOT / "tests/data/h200_w4a4_sweep_2026-11-30.json"  # run 3 (docs/gpu)
    results = json.loads(sweep.read_text())
    assert load_configs("NVIDIA H200") == best_configs(results)
    assert tuned_config("NVIDIA H200", 1).inner == "f16"  # decode: float16 codes won
    assert tuned_config("NVIDIA H200", 4096).inner == "dot_scaled"  # prefill


def test_pick_takes_the_nearest_row_count_on_a_log_scale() -> None:
    a, b, c = (KernelConfig(block_n=n) for n in (16, 32, 64))
    configs = {1: a, 16: b, 512: c}
    assert pick(configs, 0) is a and pick(configs, 1) is a and pick(configs, 3) is a
    assert pick(configs, 5) is b and pick(configs, 64) is b  # log2 64: 2 from 16, 3 from 512
    assert pick(configs, 128) is c  # 3 from 16, 2 from 512
    assert pick(configs, 100_000) is c
    assert pick(configs, 4) is a  # a tie (2 each way) takes the smaller tuned count
    assert pick({}, 7) == KernelConfig()


def test_no_file_or_no_gpu_runs_the_defaults() -> None:
    assert load_configs("Some Future GPU") == {}
    assert tuned_config("Some Future GPU", 16) == KernelConfig()
    assert tuned_config(None, 16) == KernelConfig()


def test_round_trip(tmp_path: Path) -> None:
    configs = {16: KernelConfig(inner="f16x2", swap_ab=True, block_m=256, split_k=4),
               1: KernelConfig()}
    write_configs(config_path("Test GPU", tmp_path), "Test GPU", "a test", configs)
    assert load_configs("Test GPU", tmp_path) == configs


@pytest.mark.parametrize(("text", "match"), [
    ("{not json", "not a W4A4 kernel config file"),
    ('{"device": "Test GPU", "source": "", "configs": {"1": {"inner": "fp8"}}}',
     "unknown inner product 'fp8'"),
    ('{"device": "Test GPU", "source": "", "configs": {"1": {"route": "cutlass"}}}',
     "unknown route 'cutlass'"),
    ('{"device": "Test GPU", "source": "", "configs": {"1": {"block_m": 96}}}',
     "block_m must be a power of two; got 96"),
    ('{"device": "Test GPU", "source": "", "configs": {"1": {"tiles": 3}}}',
     "unknown field `tiles`"),
    ('{"device": "Test GPU", "source": "", "configs": {"1": {"split_k": 0}}}',
     "split_k must be >= 1"),
    ('{"device": "Test GPU", "source": "", "configs": {"0": {}}}',
     r"rows per expert must be >= 1; got \[0\]"),
    ('{"device": "Other GPU", "source": "", "configs": {}}', "is for 'Other GPU'"),
])
def test_a_bad_file_is_a_clear_error_naming_it(tmp_path: Path, text: str, match: str) -> None:
    path = config_path("Test GPU", tmp_path)
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        load_configs("Test GPU", tmp_path)
    assert str(path) in str(info.value)


def timing(gemm: str, tokens: int, variant: str, config: list[int], us: float) -> dict:
    return {"gemm": gemm, "tokens_per_expert": tokens, "variant": variant,
            "config": config, "us": us}


def test_the_sweep_picks_the_least_total_over_both_gemms() -> None:
    results = [
        # 1 token: "a" is fastest on gate_up alone, "b" on the sum
        timing("gate_up", 1, "dot_scaled", [16, 128, 128, 4, 3, 1], 500.0),
        timing("down", 1, "dot_scaled", [16, 128, 128, 4, 3, 1], 300.0),
        timing("gate_up", 1, "f16x2/swap", [16, 256, 64, 4, 5, 4], 520.0),
        timing("down", 1, "f16x2/swap", [16, 256, 64, 4, 5, 4], 200.0),
        # timed on one GEMM only (the other failed to compile): not a candidate
        timing("down", 1, "f16", [16, 256, 32, 4, 3, 1], 10.0),
        # an earlier sweep's config, without split_k
        timing("gate_up", 512, "dot_scaled", [64, 128, 128, 4, 3], 5000.0),
        timing("down", 512, "dot_scaled", [64, 128, 128, 4, 3], 2500.0),
        # the bf16 route wins at 4096
        timing("gate_up", 4096, "dot_scaled", [64, 128, 128, 4, 3, 1], 9000.0),
        timing("down", 4096, "dot_scaled", [64, 128, 128, 4, 3, 1], 5000.0),
        timing("gate_up", 4096, "bf16_grouped_mm", [], 3000.0),
        timing("down", 4096, "bf16_grouped_mm", [], 2000.0),
    ]
    assert best_configs(results) == {
        1: KernelConfig(inner="f16x2", swap_ab=True, block_n=16, block_m=256, block_k=64,
                        num_warps=4, num_stages=5, split_k=4),
        512: KernelConfig(inner="dot_scaled", block_n=64, block_m=128, block_k=128,
                          num_warps=4, num_stages=3, split_k=1),
        4096: KernelConfig(route="bf16_grouped_mm")}
    best = {(b["gemm"], b["tokens_per_expert"]): b for b in best_per_shape(results)}
    assert best["down", 1]["variant"] == "f16" and best["down", 1]["tried"] == 3
    assert best["gate_up", 1]["per_variant"] == {"dot_scaled": 500.0, "f16x2/swap": 520.0}
