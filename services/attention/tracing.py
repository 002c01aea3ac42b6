"""The attention service's spans: each request's queue, prefill and decode phases, and the
sampled scheduler steps, linked to every request they served."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.context import Context
from opentelemetry.trace import Link, NonRecordingSpan, Span, set_span_in_context

from common import tracing
from common.compute import waited
from services.attention.scheduler import ScheduledSeq
from services.attention.sequence import Sequence


def _wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as wall-clock ns, since spans carry wall-clock times."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def trace_request(seq: Sequence, reason: str) -> None:
    """Emit the phases of a finished or aborted request under its sampled gateway span."""
    if seq.trace_parent is None:
        return
    parent = set_span_in_context(NonRecordingSpan(seq.trace_parent))
    tracer, end = tracing.tracer(), time.time_ns()
    marks = [("queue", _wall_ns(seq.arrival_time))]
    if seq.first_scheduled_time is not None:
        marks.append(("prefill", _wall_ns(seq.first_scheduled_time)))
    if seq.first_token_time is not None:
        marks.append(("decode", _wall_ns(seq.first_token_time)))
    for (name, start), (_, stop) in zip(marks, [*marks[1:], ("", end)], strict=True):
        tracer.start_span(name, context=parent, start_time=start, attributes={
            "switchyard.request_id": seq.request_id,
            "switchyard.output_tokens": seq.num_output_tokens,
            "switchyard.finish_reason": reason}).end(stop)


@contextmanager
def step_span(scheduled: list[ScheduledSeq]) -> Iterator[Span | None]:
    """A span around one scheduler step, linked to each sampled request it serves.

    A step serves many requests, so it is a root of its own. It is sampled like any root,
    and recorded without per-layer detail when only a request it serves is
    (`tracing._follow_links`). It ends with the step's busy and waiting seconds
    (`switchyard.busy_s`, `switchyard.wait_s`); waiting is time blocked on the expert
    services (`common.compute.waiting`). Yields the span, or None while tracing is off,
    for what the step learns at its end."""
    if not tracing.enabled():
        yield None
        return
    # One link per request span: a request's n choices share it.
    parents = {item.seq.trace_parent.span_id: item.seq.trace_parent for item in scheduled
               if item.seq.trace_parent}
    links = [Link(parent) for parent in parents.values()]
    attributes = {"switchyard.sequences": len(scheduled),
                  "switchyard.tokens": sum(item.num_new_tokens for item in scheduled)}
    with tracing.tracer().start_as_current_span("step", context=Context(), links=links,
                                                attributes=attributes) as span:
        recorded = getattr(span, "attributes", None) or {}
        start, before = time.perf_counter(), waited()
        with tracing.detail(recorded.get("switchyard.detail", True)):
            yield span
        # the step's bubbles: its time blocked on the expert services' answers
        wait = waited() - before
        span.set_attribute("switchyard.wait_s", wait)
        span.set_attribute("switchyard.busy_s", max(0.0, time.perf_counter() - start - wait))
