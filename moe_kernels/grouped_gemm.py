"""Grouped SwiGLU expert FFN over tokens already sorted by expert: float (bf16/float32) and
W4A4 MXFP4, torch paths for any device.

The W4A4 torch path decodes to float32 and runs float32 matmuls: the products are exact, so
the Triton kernel matches it bit for bit under the interpreter.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_kernels.mxfp4 import MXFP4Tensor, dequantize, quantize


def swiglu_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x [N, H], w_gate_up [2I, H], w_down [H, I] -> [N, H]."""
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)


class ExpertTimer:
    """Each expert's (start, end) wall-clock ns, appended to `spans`, if given, on `close`.

    On the CPU these are monotonic clock readings around each expert, so a clock step cannot
    bend a duration. On CUDA they are events recorded on the stream and read after the call
    with one synchronisation, so the durations are the GPU's. Either way the times are
    anchored at the wall clock when the call began; on CUDA that is its launch, not its
    start.
    """

    def __init__(self, spans: list[tuple[int, int]] | None, device: torch.device) -> None:
        self.spans = spans
        self.cuda = spans is not None and device.type == "cuda"
        self.marks: list[tuple[object, object] | None] = []
        self.wall_ns, self.clock_ns = time.time_ns(), time.perf_counter_ns()
        if self.cuda:
            self.origin = self._event()

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def now(self) -> object:
        if self.spans is None:
            return None
        return self._event() if self.cuda else time.perf_counter_ns()

    def done(self, start: object) -> None:
        if self.spans is not None:
            self.marks.append((start, self.now()))

    def idle(self) -> None:
        if self.spans is not None:
            self.marks.append(None)

    def close(self) -> None:
        if self.spans is None:
            return
        if self.cuda and self.marks:
            torch.cuda.current_stream().synchronize()
        for mark in self.marks:
            self.spans.append((self._ns(mark[0]), self._ns(mark[1])) if mark else (0, 0))

    def _ns(self, mark: object) -> int:
        if not self.cuda:
            return self.wall_ns + mark - self.clock_ns  # type: ignore[operator]
        return self.wall_ns + int(self.origin.elapsed_time(mark) * 1e6)  # type: ignore[attr-defined]


def grouped_swiglu(
    x: torch.Tensor, tokens_per_expert: list[int], w_gate_up: torch.Tensor, w_down: torch.Tensor,
    spans: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """Run each local expert's FFN on its contiguous run of rows.

    Args:
        x: [N, H] activations, rows grouped by local expert in expert order.
        tokens_per_expert: E_local ints summing to N; run e belongs to local expert e.
        w_gate_up: [E_local, 2 * I, H] gate and up projections stacked (gate first).
        w_down: [E_local, H, I] down projections.

        spans: if given, filled with each local expert's (start, end) wall-clock ns, for
            per-expert tracing; (0, 0) for experts without tokens.

    Returns:
        [N, H] expert outputs, row-aligned with `x`, not yet weighted by the router.
    """
    out = torch.empty_like(x)

    def ffn(rows: slice, expert: int) -> None:
        out[rows] = swiglu_mlp(x[rows], w_gate_up[expert], w_down[expert])

    _each_expert(tokens_per_expert, ffn, ExpertTimer(spans, x.device))
    return out


def row_ends(tokens_per_expert: list[int] | torch.Tensor, device: torch.device
             ) -> torch.Tensor:
    """[E] int32: one past each expert's last row, from host counts, or from an [E] int64
    tensor of counts on `device` without a host sync."""
    if isinstance(tokens_per_expert, torch.Tensor):
        return tokens_per_expert.cumsum(0).to(torch.int32)
    return torch.tensor(list(itertools.accumulate(tokens_per_expert)), dtype=torch.int32,
                        device=device)


def grouped_swiglu_mm(x: torch.Tensor, tokens_per_expert: list[int] | torch.Tensor,
                      w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """`grouped_swiglu` as two grouped GEMMs (`torch._grouped_mm`, torch >= 2.8): a few
    kernels per call instead of three per expert.

    It takes the same arguments and gives the same result; in float32 on the CPU, the same
    bits. There are no per-expert times, since the experts run together. The counts may be
    a tensor on x's device ([E_local] int64), for a call without a host sync.
    """
    ends = row_ends(tokens_per_expert, x.device)  # [E_local]
    gate, up = torch._grouped_mm(x, w_gate_up.transpose(-2, -1), offs=ends).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1), offs=ends)


def timed_together(spans: list[tuple[int, int]] | None, tokens_per_expert: list[int],
                   device: torch.device, run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """run() for experts that run together in one grouped kernel. Each expert with tokens
    gets the whole call's span."""
    timer = ExpertTimer(spans, device)
    start = timer.now()
    y = run()
    end = timer.now()
    for count in tokens_per_expert:
        timer.marks.append((start, end) if count else None)
    timer.close()
    return y


def _each_expert(tokens_per_expert: list[int], ffn: Callable[[slice, int], None],
                 timer: ExpertTimer) -> None:
    """ffn(rows, expert) for each local expert's run of rows, timed. Empty runs are
    skipped."""
    start = 0
    for expert, count in enumerate(tokens_per_expert):
        if not count:
            timer.idle()
            continue
        t0 = timer.now()
        ffn(slice(start, start + count), expert)
        timer.done(t0)
        start += count
    timer.close()


def mxfp4_linear(x: MXFP4Tensor, w: MXFP4Tensor) -> torch.Tensor:
    """x [N, K] @ w [M, K]^T -> [N, M] float32, both MXFP4 (blocks along K).

    The torch reference numerics: both sides are decoded exactly to float32, then multiplied
    in one float32 matmul. Every product of two MXFP4 values is exact in float32; only the
    summation order differs from a kernel's.
    """
    return F.linear(dequantize(x), dequantize(w))


def grouped_swiglu_w4a4(
    x: MXFP4Tensor, tokens_per_expert: list[int], w_gate_up: MXFP4Tensor,
    w_down: MXFP4Tensor, spans: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """W4A4 version of `grouped_swiglu`, the torch path (any device).

    Args:
        x: MXFP4 of [N, H] activations, rows grouped by local expert in expert order.
        tokens_per_expert: E_local ints summing to N.
        w_gate_up: MXFP4 of [E_local, 2 * I, H] (gate first), blocks along H.
        w_down: MXFP4 of [E_local, H, I], blocks along I.
        spans: if given, filled with each local expert's (start, end) wall-clock ns, or
            (0, 0) for one without rows. They feed the per-expert metrics and trace spans.

    Returns:
        [N, H] float32 expert outputs. The SwiGLU output between the two GEMMs is
        re-quantized to MXFP4 per row, so both GEMMs are W4A4.
    """
    n, h = x.shape
    out = torch.empty(n, h, device=x.packed.device)

    def ffn(rows: slice, expert: int) -> None:
        gate, up = mxfp4_linear(x[rows], w_gate_up[expert]).chunk(2, dim=-1)
        act = quantize(F.silu(gate) * up)  # [count, I] -> MXFP4
        out[rows] = mxfp4_linear(act, w_down[expert])

    _each_expert(tokens_per_expert, ffn, ExpertTimer(spans, x.packed.device))
    return out
