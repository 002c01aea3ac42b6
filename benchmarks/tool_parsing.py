""".venv/bin/python -m benchmarks.tool_parsing [--sizes 1000,10000,100000] [--repeat 3]

What reading tool calls costs the gateway per generated token, beside what it already
spends detokenizing that token.

One call whose arguments grow to each --sizes character count, generated token by token
with the bundled byte tokenizer (one token per byte): the incremental detokenizer's time
per token, and each parser's (named, required, hermes) on the text that token adds.
The parsers only look again at what a token may have completed (a tag's end, an
object's closing brace), so their cost per token should not grow with the call's length.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from gateway.parsers.hermes import HermesCalls
from gateway.parsers.json_calls import NamedCall, RequiredCalls
from gateway.parsers.tool_calls import ToolParser
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.tokenizer import Tokenizer
from switchyard.demo_model import DEFAULT_MODEL

PARSERS: dict[str, tuple[Callable[[], ToolParser], Callable[[str], str]]] = {
    "named": (lambda: NamedCall("f"), lambda args: args),
    "required": (RequiredCalls, lambda args: f'[{{"name": "f", "parameters": {args}}}]'),
    "hermes": (HermesCalls, lambda args: f'<tool_call>\n{{"name": "f", "arguments": {args}}}'
                                         "\n</tool_call>"),
}


def per_token(pieces: list[str], make: Callable[[], ToolParser], repeat: int) -> float:
    """Best seconds per piece over `repeat` runs of a new parser over all of them."""
    best = float("inf")
    for _ in range(repeat):
        parser = make()
        start = time.perf_counter()
        for piece in pieces:
            parser.feed(piece)
        parser.finish()
        best = min(best, time.perf_counter() - start)
    return best / len(pieces)


def detokenize(tokenizer: Tokenizer, ids: list[int], repeat: int) -> tuple[list[str], float]:
    """Each token's text, and the best seconds per token to get it."""
    best, pieces = float("inf"), []
    for _ in range(repeat):
        detokenizer = IncrementalDetokenizer(tokenizer)
        start = time.perf_counter()
        pieces = [detokenizer.add([i]) for i in ids]
        best = min(best, time.perf_counter() - start)
    return pieces, best / len(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1000,10000,100000",
                    help="the arguments' lengths in characters, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tokenizer = Tokenizer.load(DEFAULT_MODEL)
    assert tokenizer is not None
    print("| arguments (chars) | detokenizer µs/token | " +
          " | ".join(f"{name} µs/token (x detok)" for name in PARSERS) + " |")
    print("|---:|---:|" + "---:|" * len(PARSERS))
    for size in (int(s) for s in args.sizes.split(",")):
        arguments = json.dumps({"text": "x" * (size - 12)})
        cells, detok = [], 0.0
        for name, (make, write) in PARSERS.items():
            text = write(arguments)
            pieces, detok_s = detokenize(tokenizer, tokenizer.encode(text, False), args.repeat)
            assert "".join(pieces) == text
            parse_s = per_token(pieces, make, args.repeat)
            detok = detok_s if name == "named" else detok
            cells.append(f"{parse_s * 1e6:.2f} ({parse_s / detok_s:.2f}x)")
            print(f"  {name} at {size} chars: done", file=sys.stderr, flush=True)
        print(f"| {size:,} | {detok * 1e6:.2f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
