"""The demo task: operand sizes drawn evenly, a held-out tenth that evaluations draw only
from and training never does, in every slice, unrelated to what the model must compute."""

from __future__ import annotations

import random
from collections import Counter

from switchyard.demo_task import Problem, draw, draw_near, draw_training, held_out, problems
from switchyard.eval import by_slice


def every_problem() -> list[Problem]:
    return [Problem(a, op, b) for a in range(1000) for b in range(1000) for op in "+-"]


def test_a_tenth_is_held_out_evenly_over_operations_and_answers() -> None:
    held = [p for p in every_problem() if held_out(p)]
    assert 0.099 < len(held) / 2_000_000 < 0.101  # binomial sd 0.0002
    plus = sum(p.op == "+" for p in held) / len(held)
    assert 0.49 < plus < 0.51
    last_digits = Counter(p.answer[-1] for p in held)
    assert all(0.095 < n / len(held) < 0.105 for n in last_digits.values())
    negative = sum(p.answer.startswith("-") for p in held) / len(held)
    assert 0.24 < negative < 0.26  # as over all problems: half of the subtractions
    slices = Counter(p.slice for p in held)
    assert len(slices) == 9 and slices["1x1"] >= 10  # every slice has held-out problems


def test_digit_counts_are_drawn_evenly_then_the_numbers() -> None:
    rng = random.Random(3)
    drawn = [draw(rng) for _ in range(90_000)]
    slices = Counter(p.slice for p in drawn)
    assert all(0.105 < n / len(drawn) < 0.117 for n in slices.values())  # 1/9 each
    assert 0.49 < sum(p.op == "+" for p in drawn) / len(drawn) < 0.51
    assert {p.a for p in drawn if p.slice.startswith("1x")} == set(range(10))
    negative = [p for p in drawn if p.answer.startswith("-")]
    assert 0.2 < len(negative) / len(drawn) < 0.3
    assert Problem(3, "-", 7).answer == "-4" and Problem(999, "+", 999).answer == "1998"
    assert Problem(7, "+", 123).question == "What is 7 + 123?"


def test_evaluations_draw_held_out_problems_and_training_never_does() -> None:
    asked = problems(2026, 500)
    assert asked == problems(2026, 500) != problems(7, 500)
    assert all(held_out(p) for p in asked)
    rng = random.Random(0)
    trained = {draw_training(rng) for _ in range(50_000)}
    assert not trained & set(asked)
    assert not any(held_out(p) for p in trained)


def test_training_can_add_close_operands_and_still_never_draws_held_out_ones() -> None:
    rng = random.Random(5)
    near = [draw_near(rng) for _ in range(10_000)]
    assert all(abs(p.a - p.b) <= 120 for p in near)
    assert sum(p.op == "-" for p in near) > 7000  # mostly the subtractions that shrink
    def close(probs: list[Problem]) -> float:
        return sum(abs(p.a - p.b) <= 120 for p in probs) / len(probs)

    plain = [draw_training(rng) for _ in range(40_000)]
    mixed = [draw_training(rng, near=0.3) for _ in range(40_000)]
    # 30% from draw_near (all close), the rest as `draw` (often close already): sd ~0.0025
    assert abs(close(mixed) - (0.3 + 0.7 * close(plain))) < 0.015
    assert not any(held_out(p) for p in mixed)


def test_reports_count_each_slice_and_each_operation() -> None:
    probs = [Problem(1, "+", 2), Problem(10, "-", 3), Problem(4, "-", 5), Problem(100, "+", 1)]
    slices = by_slice(probs, [True, False, True, True])
    assert slices == {"1x1": (2, 2), "2x1": (0, 1), "3x1": (1, 1), "+": (2, 2), "-": (1, 2)}
