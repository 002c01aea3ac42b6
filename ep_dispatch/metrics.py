"""Dispatch and combine latency per backend, as Prometheus histograms and trace spans.

`dispatch` runs from a MoE layer call until the expert outputs are back on this rank. It
covers the layout, the exchange there and back, and the expert compute, remote or local,
which the expert side reports per expert in `switchyard:expert_compute_seconds`. `combine` is the
router-weighted sum back into token order.

The histograms are `switchyard:dispatch_seconds` and `switchyard:combine_seconds`, by
backend (`local`, `rpc`, `torch`, `nccl`, `deepep`); the spans are `dispatch layer N` and
`combine layer N`, children of the attention service's step span, on every backend.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Literal

from prometheus_client import Histogram

from common.tracing import layer_span

_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
            1.0, 2.5)
_HISTOGRAMS = {
    "dispatch": Histogram("switchyard:dispatch_seconds",
                          "MoE layer call to expert outputs back on this rank.", ["backend"],
                          buckets=_BUCKETS),
    "combine": Histogram("switchyard:combine_seconds",
                         "Router-weighted sum of expert outputs into token order.",
                         ["backend"], buckets=_BUCKETS),
}


@cache
def _histogram(stage: str, backend: str) -> Histogram:
    return _HISTOGRAMS[stage].labels(backend)


def observe(stage: Literal["dispatch", "combine"], backend: str, tokens: int,
            seconds: float) -> None:
    """Record one stage of one layer call timed elsewhere. Calls without tokens are not
    recorded."""
    if tokens:
        _histogram(stage, backend).observe(seconds)


@contextmanager
def phase(stage: Literal["dispatch", "combine"], backend: str, layer: int, tokens: int
          ) -> Iterator[None]:
    """Time one stage of one layer call inside its `{stage} layer N` span. Calls without
    tokens, such as a lockstep backend's idle rounds, are not observed."""
    with layer_span(stage, {"switchyard.layer": layer, "switchyard.tokens": tokens}):
        start = time.perf_counter()
        yield
        observe(stage, backend, tokens, time.perf_counter() - start)
