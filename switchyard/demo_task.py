"""The demo model's task: exactly checkable arithmetic asked as chat messages.

`What is 123 + 456?` -> `579`; `What is 900 - 937?` -> `-37`. Operands are 0..999.
Shared by the training script and `switchyard eval`, so both draw the same distribution.
A fixed tenth of the 2,000,000 problems is held out: training never draws them, and
evaluations draw only them (with 900,000 training examples, a third of all problems
would otherwise have been trained on).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str


def draw(rng: random.Random) -> Problem:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    if rng.random() < 0.5:
        return Problem(f"What is {a} + {b}?", str(a + b))
    return Problem(f"What is {a} - {b}?", str(a - b))


def held_out(problem: Problem) -> bool:
    """Whether `problem` is in the evaluation tenth: by a hash of the question, so that
    the split says nothing about the operands, the operation or the answer."""
    return zlib.crc32(problem.question.encode()) % 10 == 0


def draw_training(rng: random.Random) -> Problem:
    p = draw(rng)
    while held_out(p):
        p = draw(rng)
    return p


def problems(seed: int, n: int) -> list[Problem]:
    """n held-out problems, fixed by the seed: what an evaluation asks."""
    rng = random.Random(seed)
    out: list[Problem] = []
    while len(out) < n:
        if held_out(p := draw(rng)):
            out.append(p)
    return out


def is_correct(problem: Problem, reply: str) -> bool:
    return reply.strip() == problem.answer
