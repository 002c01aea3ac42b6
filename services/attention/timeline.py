"""One pipelined step's timeline: when each micro-batch computed on this rank and when
its layer calls were out with the expert services (`DenseModel.forward_pipelined`).

The engine keeps the last step's timeline (`Engine.last_timeline`), which
`benchmarks.timeline` and the overlap test read. Where the step's span is recorded in
detail, the engine draws the timeline as that span's children: one `micro-batch j` span
per micro-batch, holding its `attention layer l` and `exchange layer l` intervals. So a
tracing UI shows one micro-batch's computation inside another's exchange.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from opentelemetry.trace import set_span_in_context

from common import tracing

Kind = Literal["attention", "exchange"]
FINAL = -1  # the layer of a micro-batch's computation after its last MoE layer


@dataclass(frozen=True)
class Interval:
    """One interval of a micro-batch's step.

    kind: "attention" or "exchange". "attention" is this rank computing the micro-batch up
        to MoE layer `layer`'s call, or to the final norm where `layer` is FINAL.
        "exchange" is the layer call out, from its rows leaving until its output is
        combined; `held` is how long the slowest expert rank held it.
    Times are time.perf_counter() seconds.
    """

    kind: Kind
    micro_batch: int
    layer: int
    start: float
    end: float
    held: float = 0.0


@dataclass
class StepTimeline:
    intervals: list[Interval] = field(default_factory=list)

    def add(self, kind: Kind, micro_batch: int, layer: int, start: float,
            held: float = 0.0) -> float:
        """Record an interval from `start` until now; returns now."""
        now = time.perf_counter()
        self.intervals.append(Interval(kind, micro_batch, layer, start, now, held))
        return now

    def find(self, kind: Kind, micro_batch: int, layer: int) -> Interval:
        return next(i for i in self.intervals
                    if (i.kind, i.micro_batch, i.layer) == (kind, micro_batch, layer))

    def micro_batches(self) -> list[int]:
        return sorted({i.micro_batch for i in self.intervals})

    def draw(self) -> None:
        """The intervals as children of the current span, grouped per micro-batch."""
        if not self.intervals:
            return
        tracer = tracing.tracer()
        to_ns = time.time_ns() - time.perf_counter_ns()  # perf_counter -> wall-clock ns
        for j in self.micro_batches():
            own = [i for i in self.intervals if i.micro_batch == j]
            parent = tracer.start_span(
                f"micro-batch {j}", start_time=to_ns + int(own[0].start * 1e9),
                attributes={"switchyard.micro_batch": j})
            context = set_span_in_context(parent)
            for i in own:
                name = "attention final" if i.layer == FINAL else f"{i.kind} layer {i.layer}"
                tracer.start_span(name, context=context,
                                  start_time=to_ns + int(i.start * 1e9),
                                  attributes={"switchyard.micro_batch": j,
                                              "switchyard.layer": i.layer,
                                              "switchyard.held_s": i.held}
                                  ).end(to_ns + int(i.end * 1e9))
            parent.end(to_ns + int(own[-1].end * 1e9))
