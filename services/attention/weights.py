"""How the attention service reads its dense weights from a checkpoint.

Every tensor is read in the model's dtype, and each linear in the layout of the serving
scheme's kernel (`moe_kernels.selection.dense_weight`). That is float32 panels, or with
`--dense-quantization int8`, int8 panels on the CPU and FP8 on a GPU.

A linear stored in int8 (`switchyard quantize --dense int8`, `services.model.dense`) is
read as it is, never quantized again. Row-wise scales survive stacking, as of q, k and v
into one qkv, so a stacked linear is the stacked parts' q and s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_kernels.int8 import quantize_int8
from moe_kernels.selection import DenseWeight, dense_weight
from services.model.checkpoint import Checkpoint
from services.model.dense import SCALE_SUFFIX
from services.model.families import CheckpointError


@dataclass(frozen=True)
class WeightReader:
    """Reads one process's dense weights. `scheme` is the dense quantization, or None for
    the model's dtype."""

    ckpt: Checkpoint
    dtype: torch.dtype
    device: str
    scheme: str | None

    def get(self, name: str, *shape: int, as_dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor as it is used, in `as_dtype` or the model's dtype: norms, biases,
        embeddings, a float linear. A checkpoint whose linears are stored in int8 is served
        with the scheme, since `check_dense_quantization` refuses `none`."""
        return self.ckpt.get(name, shape, as_dtype or self.dtype).to(self.device)

    def linear(self, *parts: tuple[str, int, int]) -> DenseWeight:
        """The linear whose rows are the checkpoint's weights `parts`, each (name, N, K),
        stacked in order, in the scheme's layout."""
        if self.scheme is None:
            return self.layout(torch.cat([self.get(name, n, k) for name, n, k in parts]))
        pairs = [self._int8(name, (n, k)) for name, n, k in parts]
        return self.layout((torch.cat([q for q, _ in pairs]), torch.cat([s for _, s in pairs])))

    def layout(self, w: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> DenseWeight:
        """A weight w [..., N, K] made here, such as MLA's per-head matrices or a tied
        lm_head, or (q, s), in the scheme's layout."""
        return dense_weight(w, self.scheme, self.dtype)

    def _int8(self, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [N, K] int8, s [N] float32): as stored, or quantized now from the float
        weight."""
        if name + SCALE_SUFFIX not in self.ckpt:
            q, s = quantize_int8(self.ckpt.get(name, shape, torch.float32))
            return q.to(self.device), s.to(self.device)
        q = self.ckpt.get(name, shape, None)
        if q.dtype != torch.int8:
            raise CheckpointError(f"{self.ckpt.file_of(name)}: {name!r} has a scale "
                                  f"({name}{SCALE_SUFFIX}) but is stored as {q.dtype}, "
                                  "not int8")
        s = self.ckpt.get(name + SCALE_SUFFIX, shape[:1], torch.float32)
        return q.to(self.device), s.to(self.device)
