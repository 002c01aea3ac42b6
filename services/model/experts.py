"""A set of experts of every MoE layer, loaded from the checkpoint, and their grouped FFN."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence

import torch

from ep_dispatch.wire import RowFormat
from moe_kernels.cpu_kernels import cpu_kernels
from moe_kernels.grouped_gemm import (
    grouped_swiglu,
    grouped_swiglu_mm,
    grouped_swiglu_w4a4,
    timed_together,
)
from moe_kernels.mxfp4 import (
    MXFP4Tensor,
    ScaledBlocks,
    quantize,
)
from moe_kernels.panels import MXFP4Panels, PanelWeights, plain, plain_mxfp4
from moe_kernels.selection import (
    W4A4Kernels,
    cpu_grouped_swiglu,
    cpu_grouped_swiglu_w4a4,
    grouped_mm_runs,
    panels_for_cpu,
    quantize_fused,
)
from services.model.checkpoint import Checkpoint
from services.model.config import ModelConfig, check_quantization
from services.model.expert_metrics import ExpertMetrics

# Per-architecture names of (gate, up, down) inside one expert.
_PROJ_NAMES = {"MixtralForCausalLM": ("w1", "w3", "w2")}
_GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")  # Qwen's and DeepSeek's
log = logging.getLogger("switchyard.expert")
# One layer's stacked experts, as loaded; in the CPU kernels' panels where they run
Weights = torch.Tensor | MXFP4Tensor | PanelWeights | MXFP4Panels


def expert_tensor_names(config: ModelConfig, layer: int, expert: int) -> tuple[str, str, str]:
    base = f"model.layers.{layer}.{config.expert_prefix}.experts.{expert}"
    return tuple(f"{base}.{proj}.weight" for proj in _PROJ_NAMES.get(config.architecture,
                                                                  _GATE_UP_DOWN))


def packed_names(weight_name: str) -> tuple[str, str]:
    """Where a quantized checkpoint keeps one weight: packed E2M1 codes, E8M0 scales."""
    return f"{weight_name}_packed", f"{weight_name}_scale"


def _components(w: torch.Tensor | MXFP4Tensor) -> tuple[torch.Tensor, ...]:
    return (w.packed, w.scales) if isinstance(w, MXFP4Tensor) else (w,)


def _empty_stack(like: torch.Tensor | MXFP4Tensor, n: int, rows: int,
                 device: torch.device) -> torch.Tensor | MXFP4Tensor:
    """[n, rows, ...] uninitialised, of `like`'s kind; for MXFP4, its codes and scales."""
    parts = [torch.empty((n, rows, *c.shape[1:]), dtype=c.dtype, device=device)
             for c in _components(like)]
    return MXFP4Tensor(*parts) if isinstance(like, MXFP4Tensor) else parts[0]


def _put(stack: torch.Tensor | MXFP4Tensor, i: int, row: int,
         w: torch.Tensor | MXFP4Tensor) -> None:
    """Copy one weight [r, ...] into `stack[i, row:row + r]`."""
    for out, part in zip(_components(stack), _components(w), strict=True):
        out[i, row:row + part.shape[0]].copy_(part)


def all_experts(config: ModelConfig) -> dict[int, list[int]]:
    """Every expert of every MoE layer, the MTP layers' included. This is what the
    in-process `local` backend holds."""
    return {layer: list(range(config.num_experts))
            for layer in config.served_moe_layers()}


class ExpertBank:
    """Some experts of every MoE layer: `experts[layer]` lists global ids, ascending.

    Weights per MoE layer are w_gate_up [E_local, 2 * I, H] and w_down [E_local, H, I], in
    `dtype`. Float32 on the CPU is in the kernels' panel layout (`moe_kernels.panels`). With
    quantization "w4a4" they are MXFP4, in blocks along the reduction dimension; on the CPU
    they are in the W4A4 kernel's panels where it runs AVX512-VNNI.
    Only these experts' tensors are read from the checkpoint, one at a time. A quantized
    checkpoint is read packed, never in full precision. Every layer call is recorded in
    the per-expert metrics of expert rank `rank`.
    """

    def __init__(
        self, config: ModelConfig, checkpoint: Checkpoint, experts: Mapping[int, Sequence[int]],
        dtype: torch.dtype, quantization: str = "auto", rank: int = 0,
        device: str = "cpu",
    ) -> None:
        self.experts = {layer: list(ids) for layer, ids in experts.items()}
        self.metrics = ExpertMetrics(rank)
        self.dtype = dtype
        self.device = torch.device(device)
        self._grouped_mm: bool | None = None  # torch._grouped_mm works here, once known
        self.hidden_size = config.hidden_size
        self.quantization = check_quantization(config, quantization)
        self.w_gate_up: dict[int, Weights] = {}
        self.w_down: dict[int, Weights] = {}
        self._config = config
        for layer, expert_ids in self.experts.items():
            if expert_ids:
                self.w_gate_up[layer], self.w_down[layer] = self._load_layer(checkpoint, layer,
                                                                             expert_ids)
        # W4A4 on a GPU: its kernel configs and the weight layouts they read
        self.kernels = W4A4Kernels(self.device, self.w_gate_up, self.w_down) \
            if self.quantization else None  # type: ignore[arg-type]

    def _load_layer(self, checkpoint: Checkpoint, layer: int, expert_ids: Sequence[int]
                    ) -> tuple[Weights, Weights]:
        """One layer's (w_gate_up, w_down) of these experts. Each tensor is read once into
        its place in the layer's stack. On the CPU the stacks then go into the kernels'
        panel layouts: float32, or MXFP4 where VNNI runs."""
        config = self._config
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        n = len(expert_ids)
        gate_up = down = None
        for i, expert in enumerate(expert_ids):
            g, u, d = expert_tensor_names(config, layer, expert)
            w_gate = self._load(checkpoint, config, g, (inter, hidden))
            if gate_up is None:
                gate_up = _empty_stack(w_gate, n, 2 * inter, self.device)  # [E, 2I, H]
            _put(gate_up, i, 0, w_gate)
            _put(gate_up, i, inter, self._load(checkpoint, config, u, (inter, hidden)))
            w_down = self._load(checkpoint, config, d, (hidden, inter))
            if down is None:
                down = _empty_stack(w_down, n, hidden, self.device)  # [E, H, I]
            _put(down, i, 0, w_down)
        assert gate_up is not None and down is not None  # callers skip empty shares
        return panels_for_cpu(gate_up), panels_for_cpu(down)

    def moved_to(self, experts: Mapping[int, Sequence[int]], checkpoint: Checkpoint,
                 progress: Callable[[int, int], None] | None = None) -> ExpertBank:
        """A bank of these experts, a new placement's share. Each layer whose experts did
        not change shares this bank's tensors. The others are read from the checkpoint,
        one layer at a time, W4A4 weights with their scales. The metrics are this bank's.
        `progress(done, total)` follows the layers read."""
        new = copy.copy(self)
        new.experts = {layer: list(ids) for layer, ids in experts.items()}
        new.w_gate_up, new.w_down = dict(self.w_gate_up), dict(self.w_down)
        moved = [layer for layer, ids in new.experts.items()
                 if ids != self.experts.get(layer)]
        for done, layer in enumerate(moved, 1):
            new.w_gate_up.pop(layer, None)
            new.w_down.pop(layer, None)
            if new.experts[layer]:
                new.w_gate_up[layer], new.w_down[layer] = new._load_layer(
                    checkpoint, layer, new.experts[layer])
            if progress is not None:
                progress(done, len(moved))
        new.kernels = W4A4Kernels(new.device, new.w_gate_up, new.w_down) \
            if new.quantization else None  # type: ignore[arg-type]
        return new

    def _load(self, ckpt: Checkpoint, config: ModelConfig, name: str,
              shape: tuple[int, int]) -> torch.Tensor | MXFP4Tensor:
        if config.quantization:
            packed, scale = packed_names(name)
            rows, k = shape
            return MXFP4Tensor(ckpt.get(packed, (rows, k // 2), torch.uint8),
                               ckpt.get(scale, (rows, k // 32), torch.uint8))
        if not self.quantization:
            return ckpt.get(name, shape, self.dtype).to(self.device)
        # Quantize from float32, which is exact for any stored float dtype, as `switchyard
        # quantize` does. A bf16 serving dtype first would round twice: a value just past a
        # tie would land on it.
        return quantize(ckpt.get(name, shape, torch.float32).to(self.device))

    @property
    def rows(self) -> RowFormat:
        """What a dispatched row to these experts is: H values, or with w4a4 its
        H/2 + H/32 MXFP4 bytes."""
        return RowFormat(self.hidden_size, self.dtype, self.quantization)

    def forward(self, layer: int, x: torch.Tensor, tokens_per_expert: list[int],
                spans: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """Expert FFN of N rows grouped by local expert -> [N, H], router weights not applied.

        x: [N, H] activations, or for w4a4 [N, H/2 + H/32] uint8 MXFP4 rows
        (`MXFP4Tensor.to_rows`), as the attention side dispatches them. `spans`, if given,
        gets each local expert's (start, end) wall-clock ns.
        """
        spans = [] if spans is None else spans
        if x.shape[0] == 0:
            spans.extend((0, 0) for _ in tokens_per_expert)  # one per expert, as promised
            return torch.zeros(0, self.hidden_size, dtype=self.dtype, device=self.device)
        if not self.quantization:
            y = self._float_ffn(x, tokens_per_expert, self.w_gate_up[layer],
                                self.w_down[layer], spans)  # [N, H]
        else:
            q = MXFP4Tensor.from_rows(x, self.hidden_size) if x.dtype == torch.uint8 \
                else quantize_fused(x)
            if self.device.type == "cuda":
                y = self._triton_w4a4(layer, q, tokens_per_expert, spans)
            elif (y := cpu_grouped_swiglu_w4a4(q, tokens_per_expert, self.w_gate_up[layer],
                                               self.w_down[layer], spans)) is None:
                y = grouped_swiglu_w4a4(q, tokens_per_expert, plain_mxfp4(self.w_gate_up[layer]),
                                        plain_mxfp4(self.w_down[layer]), spans)
            y = y.to(self.dtype)
        self.metrics.observe(layer, self.experts[layer], tokens_per_expert, spans)
        return y

    def forward_layer(self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """A whole MoE layer whose every expert is in this bank, in expert order, by one
        compiled call.

        Tokens x [T, H] float32 are routed to topk_ids [T, K] with topk_weights [T, K].
        Returns out [T, H], their weighted sum in token order, and when the combine began,
        in perf_counter ns. The call (`local_moe`) does the layout, the MXFP4 activations
        where W4A4, the grouped experts and the combine, with the same bits as
        `ep_dispatch.local`'s parts. Returns None where it does not apply: off the CPU or
        not in float32, without the kernels built, or with the weights not in their panels.
        The caller then runs the parts.
        """
        gate_up, down = self.w_gate_up.get(layer), self.w_down.get(layer)
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[0] == 0 \
                or len(self.experts.get(layer, ())) != self._config.num_experts \
                or (kernels := cpu_kernels()) is None:
            return None
        if isinstance(gate_up, MXFP4Panels) and isinstance(down, MXFP4Panels):
            args = (gate_up.packed, gate_up.scales, down.packed, down.scales)
        elif isinstance(gate_up, PanelWeights) and isinstance(down, PanelWeights) \
                and not self.quantization and gate_up.columns is None and down.columns is None:
            args = (gate_up.panels, None, down.panels, None)
        else:
            return None
        out, counts, marks = kernels.local_moe(x.contiguous(), topk_ids, topk_weights, *args)
        self.metrics.observe(layer, self.experts[layer], counts,
                             list(zip(marks[:-1:2], marks[1:-1:2], strict=True)))
        return out, marks[-1]

    def forward_on_device(self, layer: int, x: torch.Tensor, counts: torch.Tensor,
                          max_rows: int) -> torch.Tensor:
        """`forward` on counts left on the device, without a host synchronisation, for a
        CUDA graph. It runs grouped kernels only: `torch._grouped_mm`, or the W4A4 Triton
        kernel on CUDA. There are no per-expert metrics, which need the counts on the host.

        x: as `forward`'s. counts: [E_local] int64 on x's device, rows per local expert.
        max_rows: a bound on every count; the number of tokens will do.
        """
        if x.shape[0] == 0:
            return torch.zeros(0, self.hidden_size, dtype=self.dtype, device=self.device)
        w_gate_up, w_down = self.w_gate_up[layer], self.w_down[layer]
        if not self.quantization:
            w_gate_up, w_down = plain(w_gate_up), plain(w_down)
            if self.device.type == "cuda" and self._grouped_mm is None:  # a graph's first
                self._grouped_mm = grouped_mm_runs(  # warm-up, where a sync is allowed
                    x, counts.tolist(), w_gate_up, w_down)
            if self.device.type == "cuda" and not self._grouped_mm:
                raise ValueError("torch._grouped_mm does not run here: the experts need host "
                                 "counts")
            return grouped_swiglu_mm(x, counts, w_gate_up, w_down).to(self.dtype)  # [N, H]
        if self.device.type != "cuda":
            raise ValueError("W4A4 experts on device-side counts run the Triton kernel: "
                             "--device cuda")
        from moe_kernels.triton_mxfp4 import grouped_swiglu_w4a4_triton

        q = MXFP4Tensor.from_rows(x, self.hidden_size) if x.dtype == torch.uint8 \
            else quantize_fused(x)
        mean = -(-x.shape[0] // counts.shape[0])  # the tuned table's key: rows per expert
        assert self.kernels is not None  # quantized
        config = self.kernels.config(layer, q, counts, max_rows, mean)
        return grouped_swiglu_w4a4_triton(q, counts, *self.kernels.layout(layer, config), config,
                                          max_rows).to(self.dtype)  # [N, H]

    def _float_ffn(self, x: torch.Tensor, tokens_per_expert: list[int],
                   w_gate_up: torch.Tensor | PanelWeights, w_down: torch.Tensor | PanelWeights,
                   spans: list[tuple[int, int]]) -> torch.Tensor:
        """On the CPU in float32, the compiled kernel, one call per layer. On CUDA, two
        grouped GEMMs where `torch._grouped_mm` runs and agrees; its experts then share the
        call's span. Otherwise expert by expert, each timed on its own."""
        if self.device.type == "cpu" and (y := cpu_grouped_swiglu(
                x, tokens_per_expert, w_gate_up, w_down, spans)) is not None:
            return y
        w_gate_up, w_down = plain(w_gate_up), plain(w_down)  # kernels off since load
        if self._grouped_mm is None:  # once: can this torch group them here?
            self._grouped_mm = self.device.type == "cuda" and grouped_mm_runs(
                x, tokens_per_expert, w_gate_up, w_down)
        if self._grouped_mm:
            return timed_together(spans, tokens_per_expert, self.device, lambda: (
                grouped_swiglu_mm(x, tokens_per_expert, w_gate_up, w_down)))
        return grouped_swiglu(x, tokens_per_expert, w_gate_up, w_down, spans)

    def _triton_w4a4(self, layer: int, q: MXFP4Tensor, tokens_per_expert: list[int],
                     spans: list[tuple[int, int]]) -> torch.Tensor:
        """The GPU path: one grouped Triton kernel per GEMM, in the variant tuned for this
        GPU (`moe_kernels.kernel_configs`). Its experts run together, so each expert's span
        is the whole call's."""
        from moe_kernels.triton_mxfp4 import grouped_swiglu_w4a4_triton

        assert self.kernels is not None  # quantized
        config = self.kernels.config(layer, q, tokens_per_expert,
                                     max(tokens_per_expert, default=0))
        w_gate_up, w_down = self.kernels.layout(layer, config)
        return timed_together(spans, tokens_per_expert, self.device, lambda: (
            grouped_swiglu_w4a4_triton(q, tokens_per_expert, w_gate_up, w_down, config)))

    def nbytes(self) -> int:
        total = 0
        for w in [*self.w_gate_up.values(), *self.w_down.values()]:
            total += w.nbytes() if isinstance(w, ScaledBlocks | PanelWeights | MXFP4Panels) \
                else w.numel() * w.element_size()
        return total + (self.kernels.layout_bytes() if self.kernels else 0)


