""".venv/bin/python -m benchmarks.floor [--batch-sizes 1 16 64] [--cpu-kernels on off]
    [--quantization none w4a4] [--dense-quantization none int8]
    [--checkpoint qwen3-moe-mid|deepseek-v3-mid]

Decode step time of the engine vs. the floor of the bytes it must read and the FLOPs it
must do, and where the step's time goes.

Measures this machine once (read bandwidth: `sum` over 2 GiB; copy bandwidth; float32
matmul GFLOP/s), then runs the engine in-process (`local` backend) on a mid-size
checkpoint of benchmarks/generate.py (Qwen3-MoE, or DeepSeek-V3-shaped) and, for each
decode step, counts the bytes that step had to read: the experts its tokens were routed
to (from the engine's routing counters, exactly), every dense weight (attention, norms,
router gates, shared experts, dense layers, lm_head), and the KV cache of the batch; and
the FLOPs of its matmuls and attention. The floor is the larger of the bytes at the
measured read bandwidth and the FLOPs at the measured matmul rate; the table gives the
median step time as a multiple of it, and the step's median time in each part:
the attention blocks (norms, qkv, rotary, KV write, attention, o), router, dispatch and
combine, the experts, the shared experts, lm_head and sampling, the rest.
With `--cpu-kernels on off` each batch size runs with the compiled CPU kernels (experts,
dense projections, lm_head, attention, the layer math) and with torch's, one engine each
(the weights' layout is chosen at load); with `--quantization none w4a4` both float32 and
W4A4 experts (MXFP4, quantized at load), one engine each; with `--dense-quantization none
int8` the dense linears in float32 and in int8 (`moe_kernels.int8`), one engine each.
The engines' decode steps are taken in turn, one step of each per round, so that the
shared host's drift falls on every column alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.generate import CHECKPOINTS, add_workdir_flag, build_checkpoint, make_prompts
from benchmarks.timing import timed
from common.messages import GenerateRequest, SamplingParams
from moe_kernels.cpu_kernels import cpu_kernels, set_enabled
from moe_kernels.int8 import Int8Panels
from moe_kernels.panels import PanelWeights
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine


def _bandwidth() -> tuple[float, float]:
    """(read, copy) GB/s over 2 GiB of float32; the tensors die with this frame."""
    a = torch.randn(512 * 1024 * 1024)
    b = torch.empty_like(a)
    read = a.numel() * 4 / timed(a.sum) / 1e9
    copy = 2 * a.numel() * 4 / timed(lambda: b.copy_(a)) / 1e9
    return read, copy


class Probe:
    """The machine's read bandwidth and matmul rate, sampled once per round beside the
    steps (one 2 GiB `sum`, one 2048^3 matmul), so the floor is the machine as it was
    while they ran."""

    def __init__(self) -> None:
        self.a, self.m = torch.randn(512 * 1024 * 1024), torch.randn(2048, 2048)
        self.samples: list[tuple[float, float]] = []  # (read GB/s, matmul GFLOP/s)

    def sample(self) -> None:
        start = time.perf_counter()
        self.a.sum()
        read = self.a.numel() * 4 / (time.perf_counter() - start) / 1e9
        start = time.perf_counter()
        self.m @ self.m
        self.samples.append((read, 2 * 2048**3 / (time.perf_counter() - start) / 1e9))

    def median(self, since: int) -> tuple[float, float]:
        """Median read GB/s and GFLOP/s of the samples from index `since` on."""
        rows = self.samples[since:]
        return statistics.median(r for r, _ in rows), statistics.median(g for _, g in rows)


def machine() -> dict[str, float]:
    read, copy = _bandwidth()
    m = torch.randn(2048, 2048)
    gflops = 2 * 2048**3 / timed(lambda: m @ m) / 1e9
    return {"read_gbs": read, "copy_gbs": copy, "matmul_gflops": gflops}


Weight = torch.Tensor | PanelWeights | Int8Panels


def layer_weights(w: object) -> list[Weight]:
    """Every weight of a layer (`LayerWeights`, with MLA's and the shared experts')."""
    out: list[Weight] = []
    for field in dataclasses.fields(w):  # type: ignore[arg-type]
        value = getattr(w, field.name)
        if isinstance(value, Weight):
            out.append(value)
        elif dataclasses.is_dataclass(value):
            out += layer_weights(value)
    return out


def dense_bytes(engine: Engine) -> int:
    model = engine.runner.model
    tensors = [model.norm, model.lm_head, *(t for w in model.layers for t in layer_weights(w))]
    return sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes()
               for t in tensors)


def expert_bytes(engine: Engine) -> int:
    """Bytes of one expert's three projections: float, or MXFP4's 4.25 bits per weight."""
    cfg = engine.model_config
    weights = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    if engine.quantization == "w4a4":
        return weights // 2 + weights // 32
    return weights * engine.dtype.itemsize


def kv_bytes(engine: Engine) -> int:
    cfg = engine.model_config
    per_token = cfg.num_layers * cfg.kv_elements_per_token * engine.dtype.itemsize
    return per_token * sum(s.num_computed_tokens for s in engine.scheduler.running)


def kv_per_token(engine: Engine) -> str:
    """The KV cache's bytes per token, and with MLA those of the same model's heads in
    multi-head attention (each head's key, qk_head_dim, and value, v_head_dim)."""
    cfg, size = engine.model_config, engine.dtype.itemsize
    own = cfg.num_layers * cfg.kv_elements_per_token * size
    if cfg.mla is None:
        return f"KV cache: {own} bytes per token"
    mha = cfg.num_layers * cfg.num_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim) * size
    return (f"KV cache: {own} bytes per token (MLA's latent and rotary key); multi-head "
            f"attention with the same heads: {mha} ({mha / own:.1f}x)")


def step_flops(engine: Engine) -> int:
    """FLOPs of one decode step of the running batch: every dense matmul for each token,
    each token's top-k experts (three projections), and attention over each context."""
    cfg, model = engine.model_config, engine.runner.model
    running = engine.scheduler.running
    dense = math.prod(model.lm_head.shape) + sum(  # every matrix (not the norms)
        math.prod(t.shape) for w in model.layers for t in layer_weights(w) if len(t.shape) > 1)
    experts = len(cfg.moe_layer_ids) * cfg.top_k * 3 * cfg.hidden_size * \
        cfg.moe_intermediate_size
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * \
        sum(s.num_computed_tokens + 1 for s in running)
    return 2 * len(running) * (dense + experts) + attention


PARTS = ("attention block", "router", "dispatch + combine", "experts", "shared experts",
         "lm_head + sampling", "rest")
KERNELS = "in compiled kernels"  # across the parts: the rest of the step is host work


class StepParts:
    """Seconds of each part of the engine's steps, by wrapping the functions the step
    calls (attention, router, the local experts client and its experts, lm_head, sampling);
    `dispatch + combine` is the experts client's time outside the experts (where a local
    layer runs as one compiled call, `experts` is that call, its sort and combine
    included), `rest` the step's time outside every part."""

    def __init__(self, engine: Engine) -> None:
        import services.attention.engine as engine_module
        import services.attention.model as model_module

        self.seconds = dict.fromkeys(PARTS, 0.0)
        experts, model = engine.runner.experts, engine.runner.model
        model.attention_block = self._timed("attention block",  # type: ignore[method-assign]
                                            model.attention_block)
        model_module.route = self._timed("router", model_module.route)
        model_module.shared_experts = self._timed("shared experts",
                                                  model_module.shared_experts)
        experts.expert_fn = self._timed("experts", experts.expert_fn)  # type: ignore[attr-defined]
        if getattr(experts, "layer_fn", None) is not None:  # a local layer in one call:
            experts.layer_fn = self._timed("experts",  # type: ignore[attr-defined]
                                           experts.layer_fn)  # its sort and combine too
        call = type(experts).__call__
        type(experts).__call__ = self._timed("dispatch + combine", call)  # type: ignore[method-assign]
        model.logits = self._timed("lm_head + sampling", model.logits)  # type: ignore[method-assign]
        engine_module.sample = self._timed("lm_head + sampling", engine_module.sample)
        self._time_kernels()

    def _time_kernels(self) -> None:
        """Wrap each function of the compiled CPU kernels' module (once per process: every
        engine's steps call the same module), timing into `StepParts.kernel_seconds`."""
        module = cpu_kernels()
        if module is None or getattr(module, "_timed_by_floor", False):
            return
        for name in dir(module):
            fn = getattr(module, name)
            if callable(fn) and not name.startswith("_"):
                setattr(module, name, _timed_kernel(fn))
        module._timed_by_floor = True  # type: ignore[attr-defined]

    def _timed(self, part: str, fn: object) -> object:
        def run(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)  # type: ignore[operator]
            finally:
                self.seconds[part] += time.perf_counter() - start
        return run

    def of(self, step: Callable[[], object]) -> dict[str, float]:
        """Run one step; the seconds of each part of it, and of its compiled kernels."""
        self.seconds = dict.fromkeys(PARTS, 0.0)
        _kernel_seconds[0] = 0.0
        start = time.perf_counter()
        step()
        total = time.perf_counter() - start
        parts = dict(self.seconds)
        parts["dispatch + combine"] -= parts["experts"]  # the experts run inside the call
        parts["rest"] = total - sum(parts.values())
        parts[KERNELS] = _kernel_seconds[0]
        return parts


_kernel_seconds = [0.0]  # in the compiled kernels' calls since the step began


def _timed_kernel(fn: Callable[..., object]) -> Callable[..., object]:
    def run(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _kernel_seconds[0] += time.perf_counter() - start
    return run


Step = tuple[float, int, int, dict[str, float]]  # seconds, bytes read, FLOPs, part seconds


def start_batch(engine: Engine, batch: int, input_len: int, steps: int) -> None:
    """Add `batch` sequences and prefill them until every one decodes."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, input_len, engine.model_config.vocab_size)):
        engine.add(GenerateRequest(f"floor-{batch}-{i}-{time.monotonic_ns()}", p, params))
    running = engine.scheduler.running
    while len(running) < batch or any(s.num_output_tokens == 0 for s in running):
        engine.step()


def decode_step(engine: Engine, parts: StepParts) -> Step:
    """One decode step of the running batch: its seconds, bytes read, FLOPs and parts."""
    before = engine.runner.model.expert_load.clone()
    kv, flops = kv_bytes(engine), step_flops(engine)
    times = parts.of(engine.step)
    hit = int(((engine.runner.model.expert_load - before) > 0).sum())
    step = sum(times[p] for p in PARTS)  # not KERNELS: they ran inside the parts
    return step, dense_bytes(engine) + hit * expert_bytes(engine) + kv, flops, times


def finish_batch(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def decode_steps(engine: Engine, parts: StepParts, batch: int, input_len: int, steps: int
                 ) -> list[Step]:
    """`steps` decode steps at `batch` sequences, of one engine."""
    start_batch(engine, batch, input_len, steps)
    out = [decode_step(engine, parts) for _ in range(steps)]
    finish_batch(engine)
    return out


def interleaved_steps(engines: dict[str, tuple[Engine, StepParts, bool]], batch: int,
                      input_len: int, steps: int, probe: Probe) -> dict[str, list[Step]]:
    """`steps` decode steps at `batch` sequences of every engine, taken in turn (one step
    of each, then the next round, then one `probe` sample), so that the host's drift in
    time falls on all alike. Each engine's value says whether the compiled CPU kernels
    run for it."""
    for name, (engine, _, kernels) in engines.items():
        set_enabled(kernels)
        print(f"batch {batch}, {name}: prefill ...", flush=True)
        start_batch(engine, batch, input_len, steps)
    out: dict[str, list[Step]] = {name: [] for name in engines}
    for _ in range(steps):
        for name, (engine, parts, kernels) in engines.items():
            set_enabled(kernels)
            out[name].append(decode_step(engine, parts))
        probe.sample()
    for engine, _, kernels in engines.values():
        set_enabled(kernels)
        finish_batch(engine)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cpu-kernels", nargs="+", choices=["on", "off"], default=["on"],
                    help="the compiled CPU kernels, torch's matmuls, or both in turn")
    ap.add_argument("--quantization", nargs="+", choices=["none", "w4a4"], default=["none"],
                    help="float32 experts, W4A4 experts, or both in turn (one engine each)")
    ap.add_argument("--dense-quantization", nargs="+", choices=["none", "int8"],
                    default=["none"], help="float32 dense linears, int8 ones, or both in turn")
    ap.add_argument("--checkpoint", choices=CHECKPOINTS, default=CHECKPOINTS[0],
                    help="the random mid-size Qwen3-MoE, or a DeepSeek-V3-shaped one (MLA)")
    add_workdir_flag(ap)
    args = ap.parse_args()
    path = build_checkpoint(args.workdir, args.checkpoint)
    print("measuring the machine ...", flush=True)
    m = machine()
    print(f"read {m['read_gbs']:.1f} GB/s, copy {m['copy_gbs']:.1f} GB/s (read + write), "
          f"float32 matmul {m['matmul_gflops']:.0f} GFLOP/s", flush=True)
    engines = {}
    for quantization, dense, kernels in itertools.product(
            args.quantization, args.dense_quantization, args.cpu_kernels):
        set_enabled(kernels == "on")  # at load: the kernels' weight layout, or torch's
        print(f"loading the engine, experts {quantization}, dense {dense}, CPU kernels "
              f"{kernels} ...", flush=True)
        engine = build_engine(AttentionConfig(
            model=path, dtype="float32", quantization=quantization, dense_quantization=dense,
            kv_cache_memory=1 << 30, max_num_batched_tokens=2048))
        engines[f"{quantization}, {dense}, {kernels}"] = (engine, StepParts(engine),
                                                          kernels == "on")
    print(kv_per_token(next(iter(engines.values()))[0]), flush=True)
    rows, probe = [], Probe()
    for batch in args.batch_sizes:
        print(f"batch {batch}: {args.steps} rounds of one decode step of each engine ...",
              flush=True)
        since = len(probe.samples)
        for name, steps in interleaved_steps(engines, batch, args.input_len, args.steps,
                                             probe).items():
            rows.append((batch, name, steps, probe.median(since)))
    print("\nfloor: at the machine's median over the batch's rounds (read GB/s, GFLOP/s); "
          "the last column at the best-of-5 machine above")
    print("\n| batch | experts, dense, CPU kernels | median step ms | MB read | GFLOP | machine "
          "(GB/s, GFLOP/s) | floor ms (bytes, FLOPs) | step / floor | "
          + " | ".join(f"{p} ms" for p in PARTS) + f" | {KERNELS} ms (host: the rest of "
          "the step) | step / best-case floor |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(PARTS) + "---:|---:|")
    for batch, kernels, steps, (read, gflops) in rows:
        med_time = statistics.median(t for t, *_ in steps)
        med_bytes = statistics.median(b for _, b, _, _ in steps)
        med_flops = statistics.median(f for _, _, f, _ in steps)
        by_bytes, by_flops = med_bytes / (read * 1e9), med_flops / (gflops * 1e9)
        floor = max(by_bytes, by_flops)
        best = max(med_bytes / (m["read_gbs"] * 1e9), med_flops / (m["matmul_gflops"] * 1e9))
        split = " | ".join(f"{1e3 * statistics.median(p[part] for *_, p in steps):.1f}"
                           for part in PARTS)
        kernel_ms = 1e3 * statistics.median(p[KERNELS] for *_, p in steps)
        host_ms = 1e3 * statistics.median(t - p[KERNELS] for t, *_, p in steps)
        print(f"| {batch} | {kernels} | {1e3 * med_time:.1f} | {med_bytes / 1e6:.0f} | "
              f"{med_flops / 1e9:.2f} | {read:.1f}, {gflops:.0f} | {1e3 * floor:.1f} "
              f"({1e3 * by_bytes:.1f}, {1e3 * by_flops:.1f}) | {med_time / floor:.2f}x | "
              f"{split} | {kernel_ms:.1f} ({host_ms:.1f}) | {med_time / best:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
