""".venv/bin/python -m benchmarks.prompt_scoring [--batch 8] [--input-len 256] [--rounds 3]

What prompt logprobs cost: prefill-only requests with and without them, side by side.

The engine in-process on the mid-size random Qwen3-MoE of `benchmarks.generate`, float32:
a batch of prompts, each asking for one token (lm-evaluation-harness's loglikelihood
request), without prompt logprobs, with them (the prompt token's own) and with 5
alternatives; transformers' forward + log_softmax over the same prompts as the reference
for the same scores. Conditions alternate over --rounds; the median is reported.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from benchmarks.generate import add_workdir_flag, build_checkpoint, make_prompts
from benchmarks.timing import alternating
from common.messages import GenerateRequest, SamplingParams
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine

CONDITIONS = {"no prompt logprobs": None, "prompt_logprobs 0": 0, "prompt_logprobs 5": 5}


def engine_run(engine: Engine, prompts: list[list[int]], k: int | None) -> Callable[[], None]:
    def run() -> None:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k)
        for i, prompt in enumerate(prompts):
            assert engine.add(GenerateRequest(f"r{i}", prompt, params)) is None
        scored = 0
        while engine.has_work():
            scored += sum(len(d.prompt_logprobs or ()) for d in engine.step())
        assert scored == (0 if k is None else sum(map(len, prompts)))
    return run


def transformers_run(model: torch.nn.Module, prompts: list[list[int]]) -> Callable[[], None]:
    def run() -> None:
        with torch.inference_mode():
            for prompt in prompts:  # one at a time: prompts of an evaluation differ in length
                ids = torch.tensor([prompt])
                model(ids).logits[0].log_softmax(-1).gather(1, ids[0, 1:, None])
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    add_workdir_flag(ap)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    path = build_checkpoint(args.workdir)
    torch.manual_seed(0)
    engine = build_engine(AttentionConfig(model=path, max_num_batched_tokens=2048,
                                    kv_cache_memory=1 << 30, dtype="float32"))
    prompts = make_prompts(args.batch, args.input_len, engine.model_config.vocab_size)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runs = {name: engine_run(engine, prompts, k) for name, k in CONDITIONS.items()}
    runs["transformers forward + log_softmax"] = transformers_run(model, prompts)
    times = alternating(runs, args.rounds)
    base = statistics.median(times["no prompt logprobs"])
    print(f"\n{args.batch} prompts of {args.input_len} tokens, 1 output token each, "
          f"median of {args.rounds}\n")
    print("| condition | seconds | prompt tokens/s | vs no prompt logprobs |")
    print("|---|---:|---:|---:|")
    for name, t in times.items():
        median = statistics.median(t)
        rate = args.batch * args.input_len / median
        print(f"| {name} | {median:.2f} | {rate:,.0f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
