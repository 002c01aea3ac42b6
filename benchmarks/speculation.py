""".venv/bin/python -m benchmarks.speculation [--batch 1 16 64] [--k 1 2 3] [--rounds 3]

What speculation costs a decode step, in process, side by side in one run.

On the mid-size checkpoint (`benchmarks.generate`, float32, `local` experts), `--batch`
sequences of random 128-token prompts decode; each configuration is timed over
`--steps` decode steps, the configurations interleaved over `--rounds` rounds (this
machine is noisy), medians reported:

- off: no speculation;
- n-gram lookup only: `--speculative-config` n-gram with k = 3, every step's lookup run
  and its drafts dropped before the scheduler (what the lookup costs where nothing
  matches);
- the verify step with k drafts: every sequence given k drafts a step (fixed tokens,
  mostly rejected), so each step scores 1 + k positions a sequence (a verify step's cost
  per extra position, whatever the drafts' acceptance).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from benchmarks.generate import add_workdir_flag, build_checkpoint
from benchmarks.serving import log
from common.messages import GenerateRequest, SamplingParams
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine
from services.attention.spec_decode.config import parse_speculative_config
from services.attention.spec_decode.speculator import Speculator


def _engine(path: Path, spec: str | None, batch: int, draft_k: int) -> Engine:
    engine = build_engine(AttentionConfig(model=path, kv_cache_memory=2 << 30,
                                          max_num_batched_tokens=max(512, batch * 8),
                                          speculative=parse_speculative_config(spec)))
    speculator = engine.speculator
    if draft_k < 0 and speculator is not None:  # the lookup, its drafts dropped
        draft = speculator.draft

        def lookup_only(running: list) -> dict:
            Speculator.settle(draft(running), [])
            return {}

        speculator.draft = lookup_only  # type: ignore[method-assign]
    if draft_k > 0 and speculator is not None:
        def always(running: list) -> dict:  # k drafts for every decoding sequence
            for seq in running:
                seq.token_ids.extend([1] * draft_k)
            return {seq: draft_k for seq in running}

        engine.speculator.draft = always  # type: ignore[method-assign]
    return engine


def _time(path: Path, spec: str | None, batch: int, steps: int, draft_k: int = 0) -> float:
    """Median seconds of a decode step of `batch` sequences."""
    engine = _engine(path, spec, batch, draft_k)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        prompt = rng.sample(range(vocab), 128)
        engine.add(GenerateRequest(f"r{i}", prompt, SamplingParams(
            max_tokens=10 * steps, temperature=0.0, ignore_eos=True)))
    while any(s.num_output_tokens == 0 for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()  # the prompts
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.close()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workdir_flag(ap)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--k", type=int, nargs="*", default=[1, 2, 3])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = build_checkpoint(args.workdir)
    ngram = '{"method": "ngram", "num_speculative_tokens": %d, "disable_by_batch_size": null}'
    configs = {"off": (None, 0), "n-gram lookup only": (ngram % 3, -1),
               **{f"verify, k={k}": (ngram % k, k) for k in args.k}}
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for batch in args.batch:
            for name, (spec, k) in configs.items():
                log(f"round {r + 1}/{args.rounds}, batch {batch}, {name} ...")
                times.setdefault((name, batch), []).append(
                    _time(path, spec, batch, args.steps, k))
    print(f"decode step, ms (median of {args.steps} steps, median of {args.rounds} "
          "rounds); in brackets against off\n")
    print("| configuration | " + " | ".join(f"batch {b}" for b in args.batch) + " |")
    print("|---|" + "---:|" * len(args.batch))
    for name in configs:
        cells = []
        for b in args.batch:
            t, off = statistics.median(times[name, b]), statistics.median(times["off", b])
            cells.append(f"{1e3 * t:.1f}" + ("" if name == "off" else f" ({t / off:.2f}x)"))
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
