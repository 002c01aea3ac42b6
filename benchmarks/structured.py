""".venv/bin/python -m benchmarks.structured [--batch 16] [--output-len 48] [--rounds 3]

What structured outputs cost: decode steps with and without a grammar, side by side.

The bundled demo model's engine in-process (float32): a batch of demo questions, every
answer forced to --output-len tokens, unconstrained, under a regex and under a JSON
schema (llguidance masks computed on the engine's thread each step). Conditions
alternate over --rounds; the median is reported.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.timing import alternating
from common.messages import GenerateRequest, SamplingParams
from gateway.parsers.structured_outputs import (
    JsonSchema,
    ResponseFormat,
    StructuredOutputs,
    grammar,
)
from gateway.text.tokenizer import Tokenizer
from services.attention.builder import build_engine
from services.attention.config import AttentionConfig
from services.attention.engine import Engine
from services.attention.grammar import allowed
from switchyard.demo_model import DEFAULT_MODEL
from switchyard.demo_task import problems

# Long on purpose: no grammar is complete before the output length (a complete one would
# end its answer, and the conditions would not generate the same number of tokens).
SCHEMA = {"type": "object", "properties": {"steps": {"type": "array", "items": {
    "type": "string"}, "minItems": 100}}, "required": ["steps"]}
CONDITIONS = {"unconstrained": None,
              "regex [0-9+= -]{500}": grammar(None, StructuredOutputs(regex="[0-9+= -]{500}")),
              "JSON schema": grammar(ResponseFormat("json_schema", JsonSchema(schema=SCHEMA)),
                                     None)}


def run(engine: Engine, prompts: list[list[int]], constraint: str | None, n: int) -> int:
    params = SamplingParams(max_tokens=n, temperature=1.0, seed=0, ignore_eos=True,
                            grammar=constraint)
    for i, prompt in enumerate(prompts):
        assert engine.add(GenerateRequest(f"r{i}", prompt, params)) is None
    tokens = 0
    while engine.has_work():
        tokens += sum(len(d.token_ids) for d in engine.step())
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tok = Tokenizer.load(DEFAULT_MODEL)
    assert tok is not None
    prompts = [tok.encode_chat([{"role": "user", "content": p.question}])
               for p in problems(0, args.batch)]
    engine = build_engine(AttentionConfig(model=DEFAULT_MODEL))
    tokens: dict[str, int] = {}

    def condition(name: str, constraint: str | None) -> Callable[[], None]:
        def once() -> None:
            tokens[name] = run(engine, prompts, constraint, args.output_len)
        return once

    times = alternating({name: condition(name, constraint)
                         for name, constraint in CONDITIONS.items()}, args.rounds)
    base = statistics.median(times["unconstrained"])
    print(f"\n{args.batch} requests x {args.output_len} tokens, median of {args.rounds}\n")
    print("| condition | output tokens | seconds | tokens/s | time vs unconstrained |")
    print("|---|---:|---:|---:|---:|")
    for name, t in times.items():
        median = statistics.median(t)
        print(f"| {name} | {tokens[name]} | {median:.2f} | {tokens[name] / median:.0f} "
              f"| {median / base:.2f}x |")
    unpack_cost()


class _Packed:
    """A matcher's stand-in: a fixed bitmask (llguidance's own time is not in this)."""

    def __init__(self, words: int, seed: int) -> None:
        self._mask = random.Random(seed).randbytes(4 * words)

    def compute_bitmask(self) -> bytes:
        return self._mask


def unpack_cost(vocab: int = 151_936) -> None:
    """The masks' unpacking alone at Qwen3's vocabulary, on this machine's CPU."""
    print(f"\nmasks unpacked to [rows, {vocab:,}] bool on the CPU, median of 10\n")
    print("| rows | ms per step |")
    print("|---:|---:|")
    for rows in (1, 16, 64):
        matchers = [_Packed((vocab + 31) // 32, i) for i in range(rows)]
        samples = []
        for _ in range(10):
            start = time.perf_counter()
            allowed(matchers, vocab, torch.device("cpu"))
            samples.append(time.perf_counter() - start)
        print(f"| {rows} | {statistics.median(samples) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
