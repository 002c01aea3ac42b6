"""CUDA graphs of decode steps.

A step's many small kernels are launched as one graph replay, where launches and not the GPU
bound a decode step. An H200 spent 7.8-12.4 ms on the 4-layer demo model's ~350 kernels per
step (docs/benchmarks.md).

A graph fixes its shapes and buffers. So a decode step of B sequences whose longest has L
keys runs the graph captured for (b, k) = (B, L) rounded up to powers of two, with k at
least `MIN_KEYS`, on static input buffers. Rows B..b are padding: token 0 at position 0,
writing their KV to a scratch slot no sequence owns and attending to it alone. Keys L..k are
masked. As in vLLM, every size is captured at start-up, largest first, so no step waits for
a capture. Later graphs reuse the first one's pool memory, which stays allocated outside
`--kv-cache-memory`. Steps with prefills, more rows or more keys than the largest size run
eagerly. Only the `local` backend's experts can be captured, because every other backend
crosses a process boundary inside the step.

Inside a graph nothing may wait for the device. So the experts run on device-side counts
(`LocalExperts.on_device`), padded rows are left out of the routing counts, and the expert
metrics skip graph-replayed steps, since their per-expert spans need host counts. Before each
capture the step runs twice: once to let first-use probes synchronise, then under torch's
sync debug mode "error", so an op that would synchronise fails there with its name.

They are turned on with `--cuda-graph-max-batch N`, which needs `--device cuda` and the
`local` backend. A decode-only step of up to N sequences whose longest has up to
`--cuda-graph-max-len` keys then replays a graph (`MIN_KEYS` is 128). Inside a graph the
experts are `torch._grouped_mm`, which captures in bf16, or the W4A4 Triton kernel with the
token count as its row bound. Graphs are off by default until a GPU run measures them;
`benchmarks/gpu_check.py` times both and compares one step's hidden states. On a CPU the
tests re-run the captured step eagerly over the same buffers.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import torch

from dcp.batch import StepBatch
from ep_dispatch.local import LocalExperts
from services.attention.kv_cache import KVCache
from services.attention.model import DenseModel

log = logging.getLogger(__name__)

MIN_KEYS = 128  # the fewest keys a graph attends over; fewer graphs, little padded work
# capture(fn) -> (fn's output, replay): replay re-runs fn's work into that output
Capture = Callable[[Callable[[], torch.Tensor]], tuple[torch.Tensor, Callable[[], None]]]


def cuda_capture(pool: object) -> Capture:
    """Capture into CUDA graphs that share one memory pool. Replays never overlap, and each
    graph's output is read before the next replay."""

    def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
        side = torch.cuda.Stream()  # warm-up off the capture stream, as torch asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # first uses: probes and kernel compiles may synchronise here
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")  # a sync now raises, naming its op
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return out, graph.replay

    return capture


def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    """What a graph replay does, without CUDA: the same ops on the same static buffers,
    writing the same output tensor. That lets a CPU check the padding and the buffers'
    numerics."""
    out = fn()
    return out, lambda: out.copy_(fn())


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class DecodeGraphs:
    """Decode steps of up to `max_batch` sequences with up to `max_len` keys each, replayed
    from graphs over static buffers.

    Arguments:
        model, kv, experts: the engine's; `experts` must be in-process (`LocalExperts`).
        scratch_slot: a KV-cache slot outside every block the block manager hands out.
        capture: `cuda_capture(pool)` on a GPU; `eager_capture` elsewhere.
    """

    def __init__(self, model: DenseModel, kv: KVCache, experts: LocalExperts, scratch_slot: int,
                 max_batch: int, max_len: int, device: torch.device, capture: Capture) -> None:
        self.model, self.kv, self.experts = model, kv, experts
        self.scratch, self.capture = scratch_slot, capture
        self.max_batch, self.max_len = next_power_of_2(max_batch), next_power_of_2(max_len)
        self.min_keys = min(MIN_KEYS, self.max_len)
        b, n = self.max_batch, self.max_len

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids, self.positions, self.slot_mapping = zeros(b), zeros(b), zeros(b)
        self.kv_slots, self.mask = zeros(b, n), zeros(b, n, dtype=torch.bool)  # [b, k]
        self.real = zeros(b)  # [b] 1 for a sequence's row, 0 for padding
        self.rows = torch.arange(b, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.Tensor, Callable[[], None]]] = {}
        self.replays: Counter[tuple[int, int]] = Counter()  # steps per size, for tests

    def sizes(self) -> list[tuple[int, int]]:
        """(rows, keys) of every graph, largest first."""
        rows = [1 << i for i in range(self.max_batch.bit_length())]
        keys = [1 << i for i in range(self.min_keys.bit_length() - 1,
                                      self.max_len.bit_length())]
        return sorted(((b, k) for b in rows for k in keys), reverse=True)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size over all-padding buffers, so nothing real is written or counted.

        Raises:
            ValueError: a step cannot be captured here; the reason is named.
        """
        self._load(None, self.max_batch, self.max_len)
        for size in self.sizes():
            try:
                self.graphs[size] = self.capture(lambda size=size: self._step(*size))
            except Exception as exc:  # a sync or an op capture cannot take: say which
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise ValueError(f"--cuda-graph-max-batch: a decode step of {size[0]} "
                                 f"sequences and {size[1]} keys cannot be captured here "
                                 f"({reason}); run without it") from exc
        log.info("captured %d decode graphs: up to %d sequences of up to %d keys",
                 len(self.graphs), self.max_batch, self.max_len)

    def fits(self, batch: StepBatch) -> bool:
        """Whether a graph can run this step: decodes only, within the sizes."""
        rows, keys = batch.decode_kv_slots.shape
        return (not batch.prefills and not batch.foreign_slots and 0 < rows <= self.max_batch
                and keys <= self.max_len and batch.input_ids.shape[0] == rows)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """`DenseModel.forward` of a step that `fits`. Returns hidden states [B, H], valid
        until the next replay."""
        rows, keys = batch.decode_kv_slots.shape
        size = (next_power_of_2(rows), max(self.min_keys, next_power_of_2(keys)))
        self._load(batch, *size)
        out, replay = self.graphs[size]
        replay()
        self.replays[size] += 1
        return out[:rows]

    def _step(self, b: int, k: int) -> torch.Tensor:
        """The captured step: the model over the static buffers' first b rows, k keys."""
        batch = StepBatch(
            input_ids=self.input_ids[:b], positions=self.positions[:b],
            slot_mapping=self.slot_mapping[:b], decode_rows=self.rows[:b],
            decode_kv_slots=self.kv_slots[:b, :k], decode_mask=self.mask[:b, :k],
            prefills=[], logits_rows=self.rows[:b], real_rows=self.real[:b])
        return self.model.forward(batch, self.kv, self.experts.on_device)

    def _load(self, batch: StepBatch | None, b: int, k: int) -> None:
        """Copy the step into the static buffers, and pad rows and keys up to (b, k). A
        `batch` of None has no rows."""
        self.input_ids[:b].zero_()
        self.positions[:b].zero_()
        self.slot_mapping[:b].fill_(self.scratch)
        self.kv_slots[:b, :k].fill_(self.scratch)
        self.mask[:b, :k].zero_()
        self.real[:b].zero_()
        n = 0
        if batch is not None:
            n, keys = batch.decode_kv_slots.shape
            self.input_ids[:n].copy_(batch.input_ids)
            self.positions[:n].copy_(batch.positions)
            self.slot_mapping[:n].copy_(batch.slot_mapping)
            self.kv_slots[:n, :keys].copy_(batch.decode_kv_slots)
            self.mask[:n, :keys].copy_(batch.decode_mask)
            self.real[:n].fill_(1)
        self.mask[n:b, 0] = True  # a padding row attends to the scratch slot alone
