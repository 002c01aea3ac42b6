"""The demo task's held-out tenth: evaluations draw only from it, training never does, and
the split is unrelated to what the model must compute."""

from __future__ import annotations

import random
from collections import Counter

from switchyard.demo_task import Problem, draw_training, held_out, problems


def every_problem() -> list[Problem]:
    return [Problem(f"What is {a} {op} {b}?", str(a + b if op == "+" else a - b))
            for a in range(1000) for b in range(1000) for op in "+-"]


def test_a_tenth_is_held_out_evenly_over_operations_and_answers() -> None:
    held = [p for p in every_problem() if held_out(p)]
    assert 0.099 < len(held) / 2_000_000 < 0.101  # binomial sd 0.0002
    plus = sum("+" in p.question for p in held) / len(held)
    assert 0.49 < plus < 0.51
    last_digits = Counter(p.answer[-1] for p in held)
    assert all(0.095 < n / len(held) < 0.105 for n in last_digits.values())
    negative = sum(p.answer.startswith("-") for p in held) / len(held)
    assert 0.24 < negative < 0.26  # as over all problems: half of the subtractions


def test_evaluations_draw_held_out_problems_and_training_never_does() -> None:
    asked = problems(2026, 500)
    assert asked == problems(2026, 500) != problems(7, 500)
    assert all(held_out(p) for p in asked)
    rng = random.Random(0)
    trained = {draw_training(rng).question for _ in range(50_000)}
    assert len(trained) > 45_000 and not trained & {p.question for p in asked}
    assert not any(held_out(Problem(q, "")) for q in trained)
