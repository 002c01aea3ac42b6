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
