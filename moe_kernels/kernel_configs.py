"""Tuned launch configurations of the W4A4 Triton kernel, one file per GPU model, as vLLM
keeps its fused-MoE configs. `configs/<device name>.json` maps rows per expert to the
variant and tiles that a sweep on that GPU measured fastest. `python -m
benchmarks.gpu_mxfp4 --sweep --write-config` writes the file for the GPU it ran on. A GPU
without a file runs `KernelConfig()`'s defaults. This module imports neither triton nor
CUDA, so configuration files are checked anywhere.

A config names the variant and its tiles, or the other route for the FFN: both operands
decoded to bf16 in one pass each, then `torch._grouped_mm` (`grouped_swiglu_w4a4_bf16`).
That route is for many tokens per expert. The key is the most rows any expert has, and the
nearest row count on a log scale picks the entry. `benchmarks/gpu_check.py` writes a file
too. A config this Triton cannot compile falls back to the in-kernel decode
(`services/model/experts.py`). An
entry in the bf16x2 layout makes the expert bank convert every layer's weights once, at
load, and keep them beside the MXFP4 ones as a second copy. Weights it cannot scale exactly,
with a block scale above 2**1, that is a weight of 16 or more, fall back the same way. The bundled
H200 table is run 3's sweep (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import msgspec

# The inner products of `moe_kernels.triton_mxfp4.grouped_mxfp4_gemm`, as its kernel numbers them.
INNER_PRODUCTS = {"dot_scaled": 0, "decode": 1, "bf16": 2, "f16": 3, "f16x2": 4, "bf16x2": 5}
# How the W4A4 FFN runs: the Triton kernel, or, for many tokens, both operands decoded to
# bfloat16 in one pass each and `torch._grouped_mm` (`triton_mxfp4.grouped_swiglu_w4a4_bf16`)
ROUTES = ("triton", "bf16_grouped_mm")
CONFIG_DIR = Path(__file__).parent / "configs"


class KernelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`grouped_mxfp4_gemm` keywords; None tiles take that function's defaults. With route
    "bf16_grouped_mm" the rest is unused."""

    route: str = "triton"
    inner: str = "dot_scaled"
    swap_ab: bool = False
    block_n: int | None = None
    block_m: int | None = None
    block_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1

    def __post_init__(self) -> None:
        if self.route not in ROUTES:
            raise ValueError(f"unknown route {self.route!r}; choose {', '.join(ROUTES)}")
        if self.inner not in INNER_PRODUCTS:
            raise ValueError(f"unknown inner product {self.inner!r}; choose "
                             f"{', '.join(INNER_PRODUCTS)}")
        for name in ("block_n", "block_m", "block_k", "num_warps"):
            size = getattr(self, name)
            if size is not None and (size < 1 or size & (size - 1)):
                raise ValueError(f"{name} must be a power of two; got {size}")
        if self.num_stages < 1 or self.split_k < 1:
            raise ValueError(f"num_stages and split_k must be >= 1; got {self.num_stages}, "
                             f"{self.split_k}")


    def gemm_options(self) -> dict[str, object]:
        """The `grouped_mxfp4_gemm` keywords, for route "triton"."""
        options = msgspec.structs.asdict(self)
        del options["route"]
        return options


class KernelConfigFile(msgspec.Struct, forbid_unknown_fields=True):
    """One GPU model's tuned configs.

    device: the name CUDA reports (`torch.cuda.get_device_name`).
    source: how the timings were measured (commit, command, date).
    configs: rows per expert (the most any expert has) -> the fastest config there.
    """

    device: str
    source: str
    configs: dict[int, KernelConfig]


def config_path(device_name: str, directory: Path = CONFIG_DIR) -> Path:
    """"NVIDIA H200" -> configs/NVIDIA_H200.json."""
    return directory / f"{device_name.replace(' ', '_')}.json"


@functools.cache
def load_configs(device_name: str, directory: Path = CONFIG_DIR) -> dict[int, KernelConfig]:
    """The tuned configs for a GPU model; {} when it has no file.

    Raises:
        ValueError: the file exists but is not a valid config file (named in the message).
    """
    path = config_path(device_name, directory)
    if not path.exists():
        return {}
    try:
        table = msgspec.json.decode(path.read_bytes(), type=KernelConfigFile)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
        raise ValueError(f"{path}: not a W4A4 kernel config file: {exc}") from exc
    if table.device != device_name:
        raise ValueError(f"{path} is for {table.device!r}, not {device_name!r}")
    if any(rows < 1 for rows in table.configs):
        raise ValueError(f"{path}: rows per expert must be >= 1; got {sorted(table.configs)}")
    return table.configs


def pick(configs: dict[int, KernelConfig], rows_per_expert: int) -> KernelConfig:
    """The config tuned for the row count nearest `rows_per_expert` on a log scale, since
    tile shapes change with the order of magnitude. The defaults when there is none."""
    if not configs:
        return KernelConfig()
    rows = max(1, rows_per_expert)
    return configs[min(configs, key=lambda tuned: (abs(math.log2(tuned / rows)), tuned))]


def tuned_config(device_name: str | None, rows_per_expert: int) -> KernelConfig:
    """`pick` from the file for `device_name`. None, as for a CPU, gives the defaults."""
    return pick(load_configs(device_name) if device_name else {}, rows_per_expert)


def write_configs(path: Path, device_name: str, source: str,
                  configs: dict[int, KernelConfig]) -> None:
    """Write a config file that `load_configs` reads back."""
    table = KernelConfigFile(device_name, source, dict(sorted(configs.items())))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(table), indent=2) + b"\n")
