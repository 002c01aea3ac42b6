"""The demo model's task: exactly checkable arithmetic asked as chat messages.

`What is 1 + 1?` -> `2`; `What is 900 - 937?` -> `-37`. Each operand's digit count (1, 2 or
3) is drawn first, equally likely, then the number (0..9, 10..99 or 100..999), so the small
sums people try first are as common as three-digit ones. Shared by the training script and
`switchyard eval`, so both draw the same distribution.

A fixed tenth of all 2,000,000 problems is held out: training never draws them, and
evaluations draw only them. Reports break accuracy down by `Problem.slice` (the operands'
digit counts) and by operation.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

DIGIT_RANGES = {1: (0, 9), 2: (10, 99), 3: (100, 999)}


@dataclass(frozen=True)
class Problem:
    a: int
    op: str  # "+" or "-"
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def answer(self) -> str:
        return str(self.a + self.b if self.op == "+" else self.a - self.b)

    @property
    def slice(self) -> str:
        """The operands' digit counts: "1x3" for `7 + 123`."""
        return f"{len(str(self.a))}x{len(str(self.b))}"


def operand(rng: random.Random) -> int:
    return rng.randint(*DIGIT_RANGES[rng.randint(1, 3)])


def draw(rng: random.Random) -> Problem:
    a, b = operand(rng), operand(rng)
    return Problem(a, "+" if rng.random() < 0.5 else "-", b)


def held_out(problem: Problem) -> bool:
    """Whether `problem` is in the evaluation tenth. A hash of the question decides, so
    that the split says nothing about the operands, the operation or the answer."""
    return zlib.crc32(problem.question.encode()) % 10 == 0


def draw_near(rng: random.Random) -> Problem:
    """A pair of close operands, with b within 120 of a. They make subtractions whose
    answer is much shorter than the operands (910 - 912 = -2), which `draw` makes too
    rarely to learn."""
    a = operand(rng)
    b = min(999, max(0, a + rng.randint(-120, 120)))
    return Problem(a, "+" if rng.random() < 0.25 else "-", b)


def draw_training(rng: random.Random, near: float = 0.0) -> Problem:
    """A problem training may see: from `draw`, or with probability `near` from
    `draw_near`; never a held-out one."""
    pick = draw_near if rng.random() < near else draw
    p = pick(rng)
    while held_out(p):
        p = pick(rng)
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
