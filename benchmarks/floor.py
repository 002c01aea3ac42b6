"""Decode step time of the engine vs. the memory-bandwidth floor of the bytes it must read.

    .venv/bin/python -m benchmarks.floor [--batch-sizes 1 16] [--input-len 128]

Measures this machine once (read bandwidth: `sum` over 2 GiB; copy bandwidth; float32
matmul GFLOP/s), then runs the engine in-process on the mid-size checkpoint of
benchmarks/generate.py and, for each decode step, counts the bytes that step had to read:
the experts its tokens were routed to (from the engine's routing counters, exactly), every
dense weight (attention, norms, router gates, lm_head), and the KV cache of the batch. The
floor is those bytes at the measured read bandwidth; the table gives the median step time
as a multiple of it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.generate import add_workdir_flag, build_checkpoint, make_prompts
from benchmarks.timing import timed
from common.messages import GenerateRequest, SamplingParams
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


def machine() -> dict[str, float]:
    read, copy = _bandwidth()
    m = torch.randn(2048, 2048)
    gflops = 2 * 2048**3 / timed(lambda: m @ m) / 1e9
    return {"read_gbs": read, "copy_gbs": copy, "matmul_gflops": gflops}


def dense_bytes(engine: Engine) -> int:
    model = engine.model
    tensors = [model.norm, model.lm_head]
    for w in model.layers:
        tensors += [t for t in (w.input_norm, w.post_attn_norm, w.qkv, w.o, w.q_norm, w.k_norm,
                                w.gate, w.mlp_gate_up, w.mlp_down) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def expert_bytes(engine: Engine) -> int:
    cfg = engine.model_config
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * engine.dtype.itemsize


def kv_bytes(engine: Engine) -> int:
    cfg = engine.model_config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.dtype.itemsize
    return per_token * sum(s.num_computed_tokens for s in engine.scheduler.running)


def decode_steps(engine: Engine, batch: int, input_len: int, steps: int
                 ) -> list[tuple[float, int]]:
    """(seconds, bytes read) of `steps` decode steps at `batch` sequences."""
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(make_prompts(batch, input_len, engine.model_config.vocab_size)):
        engine.add(GenerateRequest(f"floor-{batch}-{i}", p, params))
    running = engine.scheduler.running
    while len(running) < batch or any(s.num_output_tokens == 0 for s in running):
        engine.step()  # prefill until every sequence decodes
    out = []
    for _ in range(steps):
        before = engine.model.expert_load.clone()
        kv = kv_bytes(engine)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        hit = int(((engine.model.expert_load - before) > 0).sum())
        out.append((elapsed, dense_bytes(engine) + hit * expert_bytes(engine) + kv))
    while engine.has_work():
        engine.step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    add_workdir_flag(ap)
    args = ap.parse_args()
    path = build_checkpoint(args.workdir)
    print("measuring the machine ...", flush=True)
    m = machine()
    print(f"read {m['read_gbs']:.1f} GB/s, copy {m['copy_gbs']:.1f} GB/s (read + write), "
          f"float32 matmul {m['matmul_gflops']:.0f} GFLOP/s", flush=True)
    engine = build_engine(AttentionConfig(model=path, dtype="float32", kv_cache_memory=1 << 30,
                                    max_num_batched_tokens=2048))
    print("| batch | median step ms | MB read per step | floor ms | step / floor |")
    print("|---:|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        steps = decode_steps(engine, batch, args.input_len, args.steps)
        med_time = statistics.median(t for t, _ in steps)
        med_bytes = statistics.median(b for _, b in steps)
        floor = med_bytes / (m["read_gbs"] * 1e9)
        print(f"| {batch} | {1e3 * med_time:.1f} | {med_bytes / 1e6:.0f} | "
              f"{1e3 * floor:.1f} | {med_time / floor:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
