"""`switchyard quantize`: write a checkpoint whose experts are stored as MXFP4 (W4A4), and
with `--dense int8` whose dense linears are stored in int8 (`services.model.dense`).

Every expert weight `W` becomes `W_packed` ([out, in / 2] uint8, E2M1 codes) and
`W_scale` ([out, in / 32] uint8, E8M0). A dense linear `W` becomes `W` int8 [out, in] and
`W_scale` float32 [out]. Every other tensor is copied as is, as is every other file, such as
the tokenizer and chat template. `config.json` gains a `quantization_config`, so services load
the quantized weights directly, never in full precision. Shards are converted one at a
time, so memory holds one shard at most.

Such a checkpoint's `config.json` carries `quantization_config = {"quant_method":
"switchyard", "experts": "mxfp4", ...}`, or `"switchyard_mxfp4"` in older copies, and, with
dense int8, `"dense": "int8"`. The default `--quantization auto` serves its experts as W4A4,
as `--quantization w4a4` does a float checkpoint's, quantized at load; `none` insists on
float experts. `--dense-quantization auto` serves its int8 linears as they are. `/v1/models`
reports the quantization (`"w4a4"`), and `/health` each group's `quantization` and
`dense_quantization`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_kernels.int8 import quantize_int8
from moe_kernels.mxfp4 import BLOCK, quantize
from services.model.checkpoint import INDEX_FILE
from services.model.config import QUANT_METHOD, CheckpointError, ModelConfig, check_quantization
from services.model.dense import SCALE_SUFFIX, is_dense_linear
from services.model.experts import expert_tensor_names, packed_names


def expert_weight_names(config: ModelConfig) -> set[str]:
    """Every routed expert's weights, the MTP layers' included."""
    return {name for layer in config.moe_layer_ids + config.mtp_layer_ids
            for expert in range(config.num_experts)
            for name in expert_tensor_names(config, layer, expert)}


def quantize_checkpoint(src: Path, dst: Path, experts: bool = True,
                        dense: str | None = None) -> dict[str, int]:
    """Write the quantized copy of `src` to `dst`: the experts as MXFP4 (`experts`), and
    the dense linears in `dense`, "int8" or None. Returns the bytes of each kind quantized,
    before (as stored) and after."""
    config = ModelConfig.from_dir(src)
    if config.quantization or config.dense_quantization:
        raise CheckpointError(f"{src} is already quantized "
                              f"({config.quantization or config.dense_quantization})")
    if not experts and not dense:
        raise ValueError("nothing to quantize: give --experts mxfp4, --dense int8 or both")
    if experts:
        check_quantization(config, "w4a4")
    expert_names = expert_weight_names(config)
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{src}: no *.safetensors files")
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for i, shard in enumerate(shards, 1):
        out = {}
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                out.update(_convert(name, f.get_tensor(name), experts and name in expert_names,
                                    dense and is_dense_linear(name, expert_names), sizes))
        save_file(out, dst / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard.name))
        print(f"quantized shard {i}/{len(shards)}: {shard.name}", file=sys.stderr, flush=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", INDEX_FILE):
            shutil.copy2(path, dst / path.name)
    if len(shards) > 1:
        (dst / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                 indent=2))
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": QUANT_METHOD, **(
        {"experts": "mxfp4", "weights": "mxfp4", "activations": "mxfp4",
         "block_size": BLOCK} if experts else {}), **({"dense": dense} if dense else {})}
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    return sizes


def _convert(name: str, tensor: torch.Tensor, expert: bool, dense: bool,
             sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """One tensor as stored in the quantized copy. Its bytes are added to `sizes`."""
    if expert:
        q = quantize(tensor)
        packed, scale = packed_names(name)
        _count(sizes, "expert", tensor, q.nbytes())
        return {packed: q.packed, scale: q.scales}
    if dense:
        q, s = quantize_int8(tensor)
        _count(sizes, "dense", tensor, q.numel() + s.numel() * 4)
        return {name: q, name + SCALE_SUFFIX: s}
    return {name: tensor.contiguous()}


def _count(sizes: dict[str, int], kind: str, before: torch.Tensor, after: int) -> None:
    sizes[f"{kind}_bytes_before"] = sizes.get(f"{kind}_bytes_before", 0) + \
        before.numel() * before.element_size()
    sizes[f"{kind}_bytes_after"] = sizes.get(f"{kind}_bytes_after", 0) + after


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="switchyard quantize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path, help="HF checkpoint directory")
    ap.add_argument("--out", required=True, type=Path, help="where to write the copy")
    ap.add_argument("--experts", choices=["mxfp4", "none"], default="mxfp4",
                    help="the routed experts: mxfp4 (default; served as --quantization w4a4) "
                         "or none (as they are)")
    ap.add_argument("--dense", choices=["int8", "none"], default="none",
                    help="the dense linears: int8 (served as --dense-quantization int8) or "
                         "none (default: as they are)")
    args = ap.parse_args(argv)
    try:
        sizes = quantize_checkpoint(args.model, args.out, args.experts == "mxfp4",
                                    None if args.dense == "none" else args.dense)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"switchyard quantize: {exc}", file=sys.stderr)
        return 2
    for kind in ("expert", "dense"):
        if f"{kind}_bytes_before" in sizes:
            before, after = sizes[f"{kind}_bytes_before"], sizes[f"{kind}_bytes_after"]
            print(f"wrote {args.out}: {kind} weights {before / 1e6:.1f} MB -> "
                  f"{after / 1e6:.1f} MB ({after / before:.3f}x)")
    return 0
