"""The demo model's task: exactly checkable arithmetic asked as chat messages.

`What is 123 + 456?` -> `579`; `What is 900 - 937?` -> `-37`. Operands are 0..999.
Shared by the training script and `switchyard eval`, so both draw the same distribution.
"""

from __future__ import annotations

import random
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


def problems(seed: int, n: int) -> list[Problem]:
    rng = random.Random(seed)
    return [draw(rng) for _ in range(n)]


def is_correct(problem: Problem, reply: str) -> bool:
    return reply.strip() == problem.answer
