"""`switchyard quantize`: write a W4A4 checkpoint whose experts are stored as MXFP4.

Every expert weight `W` becomes `W_packed` ([out, in / 2] uint8, E2M1 codes) and
`W_scale` ([out, in / 32] uint8, E8M0); every other tensor is copied as is, as is every
other file (tokenizer, chat template). `config.json` gains a `quantization_config`, so
services load the packed experts directly, never in full precision. Shards are converted
one at a time, so memory holds one shard at most.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from moe_kernels.mxfp4 import BLOCK, quantize
from services.model.checkpoint import INDEX_FILE
from services.model.config import QUANT_METHOD, CheckpointError, ModelConfig, check_quantization
from services.model.experts import expert_tensor_names, packed_names


def expert_weight_names(config: ModelConfig) -> set[str]:
    """Every routed expert's weights, the MTP layers' included."""
    return {name for layer in config.moe_layer_ids + config.mtp_layer_ids
            for expert in range(config.num_experts)
            for name in expert_tensor_names(config, layer, expert)}


def quantize_checkpoint(src: Path, dst: Path) -> dict[str, int]:
    """Write the quantized copy of `src` to `dst`; returns bytes of expert weights before
    (as stored) and after."""
    config = ModelConfig.from_dir(src)
    if config.quantization:
        raise CheckpointError(f"{src} is already quantized ({config.quantization})")
    check_quantization(config, "w4a4")
    experts = expert_weight_names(config)
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{src}: no *.safetensors files")
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    sizes = {"expert_bytes_before": 0, "expert_bytes_after": 0}
    for i, shard in enumerate(shards, 1):
        out = {}
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = f.get_tensor(name)
                if name in experts:
                    q = quantize(tensor)
                    packed, scale = packed_names(name)
                    out[packed], out[scale] = q.packed, q.scales
                    sizes["expert_bytes_before"] += tensor.numel() * tensor.element_size()
                    sizes["expert_bytes_after"] += q.nbytes()
                else:
                    out[name] = tensor.contiguous()
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
    raw["quantization_config"] = {"quant_method": QUANT_METHOD, "weights": "mxfp4",
                                  "activations": "mxfp4", "block_size": BLOCK,
                                  "modules": "experts"}
    (dst / "config.json").write_text(json.dumps(raw, indent=2))
    return sizes


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="switchyard quantize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path, help="HF checkpoint directory")
    ap.add_argument("--out", required=True, type=Path, help="where to write the W4A4 copy")
    args = ap.parse_args(argv)
    try:
        sizes = quantize_checkpoint(args.model, args.out)
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"switchyard quantize: {exc}", file=sys.stderr)
        return 2
    before, after = sizes["expert_bytes_before"], sizes["expert_bytes_after"]
    print(f"wrote {args.out}: expert weights {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB "
          f"({after / before:.3f}x)")
    return 0
