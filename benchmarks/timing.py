"""Timing a call for the benchmarks: one warm-up, then `repeat` timed runs."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed(fn: Callable[[], object], repeat: int = 5,
          reduce: Callable[[list[float]], float] = min) -> float:
    """Seconds per call, reduced over the runs (min: best case; median: typical)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return reduce(times)


def alternating(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds of each named run per round, the runs alternating within each round (side
    by side on a noisy machine), after one warm-up of each; prints each round."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{name} {t[-1]:.2f}s" for name, t in times.items()), flush=True)
    return times
