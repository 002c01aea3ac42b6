"""Which kernel runs where.

This is the top of `moe_kernels`, the one module that picks between the torch versions, for
any device, and the Triton ones, for CUDA, so that the formats below never import the
kernels built on them. It picks the activations' quantizer, whether `torch._grouped_mm`
runs for float experts, and the W4A4 kernel config and weight layout (`W4A4Kernels`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_kernels.bf16x2_layout import Bf16x2Weights, to_bf16x2
from moe_kernels.cpu_kernels import cpu_kernels
from moe_kernels.fp8 import Fp8Weights, fp8_linear, fp8_weights
from moe_kernels.grouped_gemm import ExpertTimer, grouped_swiglu, grouped_swiglu_mm
from moe_kernels.int8 import Int8Panels, int8_panels, reference_linear
from moe_kernels.kernel_configs import KernelConfig, load_configs, tuned_config
from moe_kernels.mxfp4 import MXFP4Tensor, quantize
from moe_kernels.panels import PANEL, MXFP4Panels, PanelWeights, plain_mxfp4, to_panels

log = logging.getLogger("switchyard.expert")
FALLBACK_KERNEL = KernelConfig(inner="decode")  # where a tuned W4A4 config does not run
W4A4Weights = MXFP4Tensor | Bf16x2Weights  # one GEMM's weights, in a kernel's layout
# A dense linear's weight, in the layout its kernel reads (`dense_weight`)
DenseWeight = torch.Tensor | PanelWeights | Int8Panels | Fp8Weights
DENSE_SCHEMES = ("int8",)  # --dense-quantization's schemes (besides none)


def quantize_fused(x: torch.Tensor) -> MXFP4Tensor:
    """`quantize(x)` in one call.

    On the CPU it is the compiled kernels' quantizer, for float32 rows; on CUDA, one Triton
    kernel (`triton_mxfp4.quantize_mxfp4`). Both are bit for bit the same, the Triton one
    as checked under the tests' interpreter. The torch version runs 58 tensor operations per
    call, counted with a TorchDispatchMode on [32, 7168] bfloat16 rows.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 \
            and (kernels := cpu_kernels()) is not None:
        return MXFP4Tensor(*kernels.quantize_mxfp4(x))  # bit for bit `quantize`'s, in C++
    if x.device.type != "cuda":
        return quantize(x)
    from moe_kernels.triton_mxfp4 import quantize_mxfp4

    return quantize_mxfp4(x)


def panels_for_cpu(w: torch.Tensor | MXFP4Tensor, pad: bool = False
                   ) -> torch.Tensor | PanelWeights | MXFP4Tensor | MXFP4Panels:
    """A weight [..., N, K] in the layout the CPU kernels read, re-ordered once at load,
    where they run. Float32 becomes `PanelWeights`, for N a multiple of 16, or any N with
    `pad`, as for a dense linear. MXFP4 becomes `MXFP4Panels` where the VNNI kernel runs,
    for K a multiple of 128 and N of 4. Otherwise w stays as it is, for torch's matmuls and
    the GPU."""
    if isinstance(w, MXFP4Tensor):
        if w.packed.device.type != "cpu" or w.shape[-2] % 4 or (kernels := cpu_kernels()) is None:
            return w
        packed, scales = kernels.w4a4_panels(w.packed.contiguous(), w.scales.contiguous())
        return MXFP4Panels(packed, scales) if packed.dim() > w.packed.dim() else w
    if w.device.type != "cpu" or w.dtype != torch.float32 or (w.shape[-2] % PANEL and not pad) \
            or cpu_kernels() is None:
        return w
    return to_panels(w, pad)


def dense_weight(w: torch.Tensor | tuple[torch.Tensor, torch.Tensor], scheme: str | None,
                 dtype: torch.dtype) -> DenseWeight:
    """A dense linear's weight w [..., N, K] in the layout its kernel reads under `scheme`.

    The leading dims hold one matrix per head. w is as loaded in `dtype`, or, from a
    checkpoint stored in 8 bits, (q [..., N, K] int8, s [..., N] float32).

    - None: as it is; on the CPU, in float32 panels (`panels_for_cpu`, any N, padded).
    - "int8": on the CPU, int8 panels (`moe_kernels.int8`). On a GPU, FP8 with the same
      per-channel scales (`moe_kernels.fp8`), except where `torch._scaled_mm` cannot take
      it: per-head matrices, and K no multiple of 16. Those stay in `dtype`.

    On the CPU every dense linear of a step then runs one of the two compiled kernels.
    Their sums for a row do not depend on the other rows, unlike torch's matmul's, so a
    micro-batch's outputs are the whole batch's bit for bit.

    Per-head matrices whose N is no multiple of 16, as in tiny test models, stay as they
    are, because the per-head kernels write whole panels.
    """
    device = (w[0] if isinstance(w, tuple) else w).device
    if scheme is not None and scheme not in DENSE_SCHEMES:
        raise ValueError(f"unknown dense quantization {scheme!r}; choose one of "
                         f"{', '.join(DENSE_SCHEMES)}")
    if isinstance(w, torch.Tensor) and w.dim() > 2 and w.shape[-2] % PANEL:
        return w
    if scheme == "int8" and device.type == "cpu":
        return int8_panels(w)
    if isinstance(w, tuple):
        q, s = w
        w = (q.float() * s[..., None]).to(dtype)
    if scheme is None:
        return panels_for_cpu(w, pad=True)  # type: ignore[return-value]
    return (w.dim() == 2 and fp8_weights(w)) or w


def cpu_grouped_swiglu(x: torch.Tensor, tokens_per_expert: list[int],
                       w_gate_up: torch.Tensor | PanelWeights,
                       w_down: torch.Tensor | PanelWeights, spans: list[tuple[int, int]] | None
                       ) -> torch.Tensor | None:
    """`grouped_swiglu` through the compiled CPU kernel, `csrc/f32_cpu.cpp`: one call for
    every local expert, with gate, up and SwiGLU fused and each expert timed on its own.

    It applies to float32 x on the CPU, with the weights in panels (`panels_for_cpu`) and
    the kernel built. Returns None where it does not apply; the caller then runs torch's.
    """
    if x.device.type != "cpu" or x.dtype != torch.float32 \
            or not isinstance(w_gate_up, PanelWeights) or not isinstance(w_down, PanelWeights) \
            or w_gate_up.columns is not None or w_down.columns is not None:
        return None
    if (kernels := cpu_kernels()) is None:
        return None
    timer = ExpertTimer(spans, x.device)
    y, marks = kernels.grouped_swiglu_f32(x.contiguous(), tokens_per_expert, w_gate_up.panels,
                                          w_down.panels)
    _record(timer, marks)
    return y  # [N, H]


def cpu_grouped_swiglu_w4a4(x: MXFP4Tensor, tokens_per_expert: list[int],
                            w_gate_up: MXFP4Tensor | MXFP4Panels,
                            w_down: MXFP4Tensor | MXFP4Panels,
                            spans: list[tuple[int, int]] | None) -> torch.Tensor | None:
    """`grouped_swiglu_w4a4` through the compiled CPU kernel, `csrc/w4a4_cpu.cpp`.

    It reads the MXFP4 bytes as they are, in panels where given, with exact integer
    products, in one call for every local expert; each expert is given its share of the
    call's time. Returns None where it does not apply: off the CPU, or with the kernel not
    built.
    """
    if x.packed.device.type != "cpu" or (kernels := cpu_kernels()) is None:
        return None
    timer = ExpertTimer(spans, x.packed.device)
    y, marks = kernels.grouped_swiglu_w4a4(
        x.packed.contiguous(), x.scales.contiguous(), tokens_per_expert,
        w_gate_up.packed.contiguous(), w_gate_up.scales.contiguous(),
        w_down.packed.contiguous(), w_down.scales.contiguous())
    _record(timer, marks)
    return y  # [N, H] float32


def _record(timer: ExpertTimer, marks: list[int]) -> None:
    """Put a compiled grouped kernel's per-expert (start, end) monotonic ns into `timer`'s
    spans. They are 0 0 where an expert had no rows."""
    for start, end in zip(marks[::2], marks[1::2], strict=True):
        timer.marks.append((start, end) if end else None)
    timer.close()


def cpu_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor, mask: torch.Tensor, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One query token per sequence over the paged KV cache, read in place, by the compiled
    kernel (`csrc/attention_cpu.cpp`).

    Returns None where it does not apply: not float32 on the CPU, a head_dim no multiple of
    16, or the kernel not built. The caller then gathers K and V and runs torch's attention.

    Args:
        q: [B, H, D] the decode tokens' queries.
        k_cache, v_cache: [S, KVH, D] one layer's cache, slot-major; H is a multiple of KVH.
        slots: [B, L] int64, each sequence's key slots; padding may be anywhere the mask
            hides.
        mask: [B, L] bool, True where the query sees the key.
        scale: the softmax scale.

    Returns:
        out [B, H, D] float32, 0 where no key is visible, and lse [B, H] float32, the
        visible scores' log-sum-exp, -inf where none, as in `dcp.merge.partial_attention`.
    """
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.dtype != torch.float32 \
            or not k_cache.is_contiguous() or q.shape[-1] % 16 \
            or (kernels := cpu_kernels()) is None:
        return None
    return kernels.decode_attention(q, k_cache, v_cache, slots, mask, scale)


def linear(x: torch.Tensor, w: DenseWeight) -> torch.Tensor:
    """`F.linear(x, w)` without a bias, for the dense projections, router gates and lm_head:
    x [M, K] @ w [N, K]^T -> [M, N].

    Weights in panels (`panels_for_cpu`) run the compiled kernel, which streams them from
    memory once for a decode step's few rows and is compute-bound beyond. int8 weights
    (`moe_kernels.int8`) run the int8 kernel, and FP8 ones `torch._scaled_mm`. Otherwise
    torch's matmul runs; for int8 that is `int8.reference_linear`, with the same sums up to
    rounding.
    """
    if isinstance(w, Fp8Weights):
        return fp8_linear(x, w)
    if isinstance(w, Int8Panels):
        if x.dtype == torch.float32 and x.dim() == 2 and (kernels := cpu_kernels()) is not None:
            y = kernels.linear_i8(x, w.panels, w.scales)  # [M, N rounded up to 16]
            return y if w.columns is None else y[:, :w.columns]
        return reference_linear(x, w).to(x.dtype)
    if isinstance(w, PanelWeights):
        if x.dtype == torch.float32 and x.dim() == 2 and (kernels := cpu_kernels()) is not None:
            y = kernels.linear_f32(x, w.panels)  # [M, N rounded up to 16]
            return y if w.columns is None else y[:, :w.columns]
        w = w.unpack()  # the kernels were switched off after load, as benchmarks do: slow
    return F.linear(x, w)


def gpu_name(device: torch.device) -> str | None:
    """The GPU model whose tuned W4A4 table applies (`moe_kernels.kernel_configs`), if any."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def reads_bf16x2(config: KernelConfig) -> bool:
    return config.route == "triton" and config.inner == "bf16x2"


class W4A4Kernels:
    """Which W4A4 Triton kernel config runs one bank's experts on its GPU, and the weight
    layouts those read.

    The config is the one tuned for this GPU model and the rows per expert
    (`kernel_configs`). Each is tried once before its first use (`runs`), and
    `FALLBACK_KERNEL` runs where it does not run here. The bf16x2 layout (`bf16x2`) holds
    (w_gate_up, w_down) per layer, and is None once the weights proved unable to take it.
    It is made for every layer at load when the tuned table has a bf16x2 entry, else on
    first use. It is kept as a second copy beside the MXFP4 weights, which other entries
    read, and freed once no config that reads it runs.

    w_gate_up, w_down: per MoE layer, [E_local, 2I, H] and [E_local, H, I] MXFP4 weights.
        On the CPU they are in the CPU kernel's panels, read as stored by the Triton
        interpreter.
    """

    def __init__(self, device: torch.device, w_gate_up: dict[int, MXFP4Tensor | MXFP4Panels],
                 w_down: dict[int, MXFP4Tensor | MXFP4Panels]) -> None:
        self.gpu = gpu_name(device)  # the tuned table's key, asked of CUDA once
        self.w_gate_up, self.w_down = w_gate_up, w_down
        self.runs: dict[KernelConfig, bool] = {}  # Triton configs tried here
        self.bf16x2: dict[int, tuple[Bf16x2Weights, Bf16x2Weights]] | None = {}
        if self.gpu and any(map(reads_bf16x2, load_configs(self.gpu).values())):
            self._convert_bf16x2()  # now, not in the first step that reads it

    def config(self, layer: int, q: MXFP4Tensor, counts: list[int] | torch.Tensor,
               max_rows: int, rows: int | None = None) -> KernelConfig:
        """The W4A4 kernel config tuned for this GPU and `rows` per expert, by default
        `max_rows`, the most any expert has.

        It is `FALLBACK_KERNEL` where the tuned one does not run here, because this Triton
        cannot compile it or the weights do not fit its layout. The first call with a config
        tries it, and synchronises; a CUDA graph's warm-up run makes that call, never its
        capture.
        """
        config = tuned_config(self.gpu, rows or max_rows)
        if config not in self.runs:
            self.runs[config] = _kernel_runs(config, q, counts, max_rows,
                                             lambda: self.layout(layer, config))
            self._free_unread_layout()
        return config if self.runs[config] else FALLBACK_KERNEL

    def layout(self, layer: int, config: KernelConfig) -> tuple[W4A4Weights, W4A4Weights]:
        """This layer's W4A4 weights in the layout `config` reads. `to_bf16x2` refuses
        weights it cannot scale, and the config then does not run here."""
        if not reads_bf16x2(config):
            return plain_mxfp4(self.w_gate_up[layer]), plain_mxfp4(self.w_down[layer])
        if self.bf16x2 == {}:
            self._convert_bf16x2()
        if self.bf16x2 is None:
            raise ValueError("these weights do not fit the bf16x2 layout (logged before)")
        return self.bf16x2[layer]

    def _convert_bf16x2(self) -> None:
        """Put every layer's weights in the bf16x2 layout too, or none, which is logged.
        Once that fails, `layout` refuses the layout without trying again."""
        try:
            self.bf16x2 = {i: (to_bf16x2(plain_mxfp4(self.w_gate_up[i])),
                               to_bf16x2(plain_mxfp4(self.w_down[i])))
                           for i in self.w_gate_up}
        except (ValueError, torch.OutOfMemoryError) as exc:  # unscalable, or no room
            self.bf16x2 = None
            log.warning("W4A4 weights stay out of the bf16x2 layout (%s): its tuned configs "
                        "run %s", exc, FALLBACK_KERNEL)
            return
        log.info("W4A4 weights in the bf16x2 layout too: %.1f MiB more",
                 self.layout_bytes() / 2**20)

    def _free_unread_layout(self) -> None:
        """Drop the bf16x2 copy once every bf16x2 config of the tuned table, and any other
        tried, has been tried here and none runs, since nothing will read it."""
        tried = {c: ok for c, ok in self.runs.items() if reads_bf16x2(c)}
        table = load_configs(self.gpu).values() if self.gpu else ()
        if self.bf16x2 and not any(tried.values()) and \
                all(c in tried for c in table if reads_bf16x2(c)):
            self.bf16x2 = {}

    def layout_bytes(self) -> int:
        """The bytes of the layouts kept beside the MXFP4 weights."""
        return sum(w.nbytes() for pair in (self.bf16x2 or {}).values() for w in pair)


def grouped_mm_runs(x: torch.Tensor, tokens_per_expert: list[int],
                        w_gate_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs here, on a CUDA build, arch, dtype and alignment it
    supports, and agrees with the per-expert loop on a first batch. If not, the loop runs."""
    try:
        got = grouped_swiglu_mm(x, tokens_per_expert, w_gate_up, w_down).float()
    except (AttributeError, RuntimeError, TypeError, ValueError) as exc:  # unsupported here
        log.info("torch._grouped_mm does not run here (%s); experts run one by one",
                 str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False
    want = grouped_swiglu(x, tokens_per_expert, w_gate_up, w_down).float()
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    # summation order only: float32 to 1e-5; 16-bit outputs to a few of their ulps
    if not err <= (1e-5 if x.dtype == torch.float32 else 2e-2):
        log.warning("torch._grouped_mm differs from the per-expert loop here (max relative "
                    "error %.2g); experts run one by one", err)
        return False
    return True


def _kernel_runs(config: KernelConfig, q: MXFP4Tensor, counts: list[int] | torch.Tensor,
                 max_rows: int, weights: Callable[[], tuple[W4A4Weights, W4A4Weights]]) -> bool:
    """Whether `config` runs here on the `weights()` it reads. The config is tuned for this
    GPU, or the defaults: `tl.dot_scaled`, e2m1 x e2m1. If it does not run, W4A4 runs
    `FALLBACK_KERNEL`, the in-kernel decode and `tl.dot`, which benchmarks/gpu_mxfp4.py
    also times."""
    from moe_kernels.triton_mxfp4 import grouped_swiglu_w4a4_triton

    try:
        grouped_swiglu_w4a4_triton(q, counts, *weights(), config, max_rows)
        torch.cuda.synchronize()
        return True
    except Exception as exc:  # a compiler error for this arch, or weights its layout
        # cannot hold: fall back, say so
        log.warning("the W4A4 kernel config %s does not run here (%s); it runs %s",
                    config, str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                    FALLBACK_KERNEL)
        return False
