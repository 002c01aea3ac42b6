"""Which of a checkpoint's tensors the 8-bit dense scheme (`--dense-quantization int8`)
stores in int8, and under what names.

Those are the linears a decode step reads in full: the lm_head, and every `*_proj.weight`
outside the routed experts. That covers attention, MLA's projections but kv_b_proj, shared
experts, dense MLPs and the MTP layer's eh_proj. kv_b_proj stays float, because it is served
as the absorbed per-head W_UK (transposed) and W_UV, whose output channels are not its rows.
Embeddings, of which a token reads one row, norms, and the router gates, whose top-k an
error would change, stay float too.

A stored linear is `NAME.weight` int8 [N, K] and `NAME.weight_scale` float32 [N], with
w ≈ q * s per row. These are compressed-tensors' names for a per-channel scale.

`--dense-quantization int8` is taken by `serve` and by every attention service and DCP rank,
the processes that hold dense weights; `services/attention/weights.py` reads them. On the
CPU the linears run the int8 kernel (`moe_kernels.int8`); on a GPU the scheme is FP8 E4M3
weights with the same per-channel scales (`moe_kernels.fp8`). A checkpoint written by
`switchyard quantize --dense int8` says `quantization_config.dense = "int8"` and is served
as it is by `--dense-quantization auto`.
"""

from __future__ import annotations

SCALE_SUFFIX = "_scale"


def is_dense_linear(name: str, experts: set[str]) -> bool:
    """Whether the scheme stores tensor `name` in int8. `experts` holds the routed experts'
    weights, which have a scheme of their own."""
    return name not in experts and (name == "lm_head.weight" or (
        name.endswith("_proj.weight") and not name.endswith("kv_b_proj.weight")))
