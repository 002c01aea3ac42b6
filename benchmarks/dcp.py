""".venv/bin/python -m benchmarks.dcp [--contexts 1024 4096 16384 32768] [--steps 5]

Decode step time vs. context length, DCP size 1 vs. 2, with the attention part apart.

The mid-size checkpoint of benchmarks/generate.py (float32, `local` experts on the leader).
For each context length one request is prefilled to that length, then --steps decode steps
are timed (median). "attention" is the time inside the model's attention calls on the
leader: for D = 2 that is the local partial attention plus gathering and merging the
shards. D = 2 runs rank 1 as another process on the other core with one thread, rank 0
(this process) also with one thread; D = 1 gets both threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.generate import add_workdir_flag, build_checkpoint, make_prompts
from common.messages import GenerateRequest, SamplingParams
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine
from switchyard.dcp_leader import leader_engine


class AttentionTimer:
    """Wraps the model's attention, adding up the time spent in it."""

    def __init__(self, attend: Callable) -> None:
        self.attend, self.seconds = attend, 0.0

    def __call__(self, *args: object) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return self.attend(*args)
        finally:
            self.seconds += time.perf_counter() - start


def decode_times(engine: Engine, context: int, steps: int) -> tuple[float, float]:
    """(median step s, median attention s per step) at `context` tokens."""
    timer = AttentionTimer(engine.runner.model.attend)
    engine.runner.model.attend = timer
    prompt = make_prompts(1, context, engine.model_config.vocab_size)[0]
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    engine.add(GenerateRequest(f"ctx-{context}", prompt, params))
    seq = engine.scheduler.waiting[0]
    while seq.num_output_tokens == 0:
        engine.step()  # prefill, in chunks
    step_s, attn_s = [], []
    for _ in range(steps):
        timer.seconds = 0.0
        start = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - start)
        attn_s.append(timer.seconds)
    while engine.has_work():
        engine.step()
    engine.runner.model.attend = timer.attend
    return statistics.median(step_s), statistics.median(attn_s)


def long_context_checkpoint(workdir: Path, max_positions: int) -> Path:
    """The mid-size checkpoint with a longer `max_position_embeddings` (RoPE needs no
    other change); the weights are linked, not copied."""
    base = build_checkpoint(workdir)
    path = workdir / f"qwen3-moe-mid-{max_positions}"
    path.mkdir(exist_ok=True)
    for f in base.iterdir():
        if f.name != "config.json" and not (path / f.name).exists():
            (path / f.name).symlink_to(f)
    config = json.loads((base / "config.json").read_text())
    config["max_position_embeddings"] = max_positions
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--steps", type=int, default=5)
    add_workdir_flag(ap)
    args = ap.parse_args()
    path = long_context_checkpoint(args.workdir, max(args.contexts) + 64)
    settings = dict(dtype="float32", kv_cache_memory=3 << 29, max_num_batched_tokens=1024,
                    max_model_len=max(args.contexts) + 64)
    rows: dict[int, dict[int, tuple[float, float]]] = {}
    for size in (1, 2):
        print(f"D = {size} ...", file=sys.stderr, flush=True)
        if size == 1:
            torch.set_num_threads(2)
            engine = build_engine(AttentionConfig(model=path, **settings))  # type: ignore[arg-type]
            rows[1] = {c: decode_times(engine, c, args.steps) for c in args.contexts}
            del engine
        else:
            torch.set_num_threads(1)
            with leader_engine(path, 2, **settings) as engine:
                rows[2] = {c: decode_times(engine, c, args.steps) for c in args.contexts}
        for c in args.contexts:
            print(f"  context {c}: step {1e3 * rows[size][c][0]:.1f} ms, attention "
                  f"{1e3 * rows[size][c][1]:.1f} ms", file=sys.stderr, flush=True)
    print("| context | D=1 step ms | D=2 step ms | step D2/D1 | D=1 attention ms | "
          "D=2 attention ms | attention D2/D1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c in args.contexts:
        (s1, a1), (s2, a2) = rows[1][c], rows[2][c]
        print(f"| {c} | {1e3 * s1:.1f} | {1e3 * s2:.1f} | {s2 / s1:.2f}x | {1e3 * a1:.1f} | "
              f"{1e3 * a2:.1f} | {a2 / a1:.2f}x |")


if __name__ == "__main__":
    main()
