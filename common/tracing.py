"""OpenTelemetry tracing for every service, configured the standard way.

Tracing is on when `--otlp-traces-endpoint`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
`OTEL_EXPORTER_OTLP_ENDPOINT` is set. `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, or
`OTEL_EXPORTER_OTLP_PROTOCOL`, picks `http/protobuf` (the default) or `grpc`.
`OTEL_SERVICE_NAME` overrides the service's name, and `OTEL_TRACES_SAMPLER` and
`OTEL_TRACES_SAMPLER_ARG` set the sampling; the SDK reads these. When tracing is off, the
API's no-op tracer is used: no spans are built and nothing is exported.

Context crosses processes in the messages' `trace_context` field (W3C `traceparent`).

Every service calls `setup_tracing` at start; grpc needs its exporter package. While tracing
is off the code skips building span inputs (`enabled()`). The spans:

- gateway: the request span `chat {model}` / `text_completion {model}` (continuing the
  client's `traceparent`), with the GenAI attributes, output tokens, finish reasons and time
  to first token;
- attention: `queue`, `prefill` and `decode` spans under the request span, emitted when the
  request ends. A `step` span per scheduler step is linked to every sampled request it
  served. It has `dispatch layer N` and `combine layer N` children
  (`ep_dispatch.metrics.phase`, every backend), and the step's `switchyard.busy_s` and
  `switchyard.wait_s`, its bubbles. Only sampled requests carry a context. The
  link-following sampler keeps a step the sampler drops for a sampled request it serves,
  without children (`switchyard.detail=false`);
- experts: `experts layer N` under the caller's dispatch span, with one `expert N.E` span
  per local expert (`switchyard.layer`, `switchyard.expert`, `switchyard.expert_rank`,
  `switchyard.tokens`, `switchyard.duration_s`).
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceState, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.sampling import Sampler

_PROPAGATOR = TraceContextTextMapPropagator()
TRACER_NAME = "switchyard"
_enabled = False


MAX_STEP_LINKS = 4096  # span links kept, unless OTEL_SPAN_LINK_COUNT_LIMIT says otherwise


def enabled() -> bool:
    """Whether this process records spans. When it does not, skip building span inputs."""
    return _enabled


def tracing_endpoint(flag: str | None) -> str | None:
    return flag or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or \
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def setup_tracing(service: str, endpoint: str | None = None) -> bool:
    """Install an SDK tracer provider exporting over OTLP, if an endpoint is configured.
    Returns whether tracing is on.

    `SWITCHYARD_TRACES_DUMP_DIR` instead keeps the spans in the SDK's in-memory exporter
    and writes them, one JSON object per line, to `DIR/SERVICE-PID.jsonl` when the process
    exits (how the tests see one trace across processes without a collector).
    """
    dump_dir = os.environ.get("SWITCHYARD_TRACES_DUMP_DIR")
    if not tracing_endpoint(endpoint) and not dump_dir:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME", service)
    # A step links to every sampled request it serves: more than the SDK's default 128.
    links = int(os.environ.get("OTEL_SPAN_LINK_COUNT_LIMIT") or MAX_STEP_LINKS)
    provider = TracerProvider(resource=Resource.create({"service.name": name}),
                              sampler=_follow_links(), span_limits=SpanLimits(max_links=links))
    if dump_dir:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(memory))
        _at_shutdown.append(lambda: _dump(memory, os.path.join(
            dump_dir, f"{name}-{os.getpid()}.jsonl")))
    else:
        provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
    trace.set_tracer_provider(provider)
    _at_shutdown.insert(0, provider.shutdown)  # flush what is buffered, then dump
    atexit.register(shutdown)
    global _enabled
    _enabled = True
    return True


_at_shutdown: list = []


def shutdown() -> None:
    """Flush and stop tracing, at exit, or earlier where a server re-raises SIGTERM and
    so skips `atexit`, as uvicorn does. Safe to call twice."""
    while _at_shutdown:
        _at_shutdown.pop(0)()


def _dump(memory: object, path: str) -> None:
    with open(path, "w") as f:
        for span in memory.get_finished_spans():  # type: ignore[attr-defined]
            f.write(span.to_json(indent=None) + "\n")


def _exporter(flag: str | None) -> object:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or \
        os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError("OTLP over grpc needs the opentelemetry-exporter-otlp-proto-grpc "
                               "package (pip install opentelemetry-exporter-otlp-proto-grpc)"
                               ) from exc
        return OTLPSpanExporter(endpoint=flag) if flag else OTLPSpanExporter()
    if protocol != "http/protobuf":
        raise RuntimeError(f"unsupported OTLP traces protocol {protocol!r}: use http/protobuf "
                           "or grpc")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    # The flag is the full traces URL (like vLLM's); the env endpoint is a base URL the
    # exporter completes with /v1/traces itself.
    return OTLPSpanExporter(endpoint=flag) if flag else OTLPSpanExporter()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject(context: Context | None = None) -> dict[str, str]:
    """The W3C headers (`traceparent`, `tracestate`) of the current or given context."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return carrier


def extract(carrier: dict[str, str]) -> Context:
    """The context a message's `trace_context` carries. An empty one starts a new trace."""
    return _PROPAGATOR.extract(carrier)


def sampled_span(carrier: dict[str, str]) -> SpanContext | None:
    """The span a message's `trace_context` names, if it is sampled. Otherwise None, and
    the receiver records nothing for it, as its sender already decided not to."""
    if not _enabled or not carrier:
        return None
    context = get_current_span(extract(carrier)).get_span_context()
    return context if context.is_valid and context.trace_flags.sampled else None


_DETAIL: ContextVar[bool] = ContextVar("switchyard_trace_detail", default=True)


def detailed() -> bool:
    """Whether per-layer and per-expert spans are wanted here. They are when the current
    span records, and is not a step recorded only for the sampled requests it serves
    (`detail`)."""
    return _enabled and _DETAIL.get() and get_current_span().is_recording()


@contextmanager
def detail(wanted: bool) -> Iterator[None]:
    """Within this block, per-layer and per-expert spans are built only if `wanted`."""
    token = _DETAIL.set(wanted)
    try:
        yield
    finally:
        _DETAIL.reset(token)


def layer_span(stage: str, attributes: dict[str, int]) -> AbstractContextManager:
    """`{stage} layer N` as the current span where detail is wanted, else nothing."""
    if not detailed():
        return nullcontext()
    return tracer().start_as_current_span(f"{stage} layer {attributes['switchyard.layer']}",
                                          attributes=attributes)


def _follow_links() -> Sampler:
    """The sampler the `OTEL_TRACES_SAMPLER*` variables configure, with one exception.

    A root span it drops is still recorded when linked to a sampled span, marked
    `switchyard.detail=False`. So a scheduler step that serves a sampled request is always
    there, and the request's trace shows all of its steps. The step's per-layer and
    per-expert spans are there only when the sampler picked the step itself; a step of 256
    requests serves a 1%-sampled one most of the time.
    """
    from opentelemetry.sdk.trace.sampling import (
        Decision,
        Sampler,
        SamplingResult,
        _get_from_env_or_default,
    )

    class FollowLinks(Sampler):
        def __init__(self, base: Sampler) -> None:
            self.base = base

        def should_sample(self, parent_context: Context | None, trace_id: int, name: str,
                          kind: SpanKind | None = None, attributes: Attributes = None,
                          links: Sequence[Link] | None = None,
                          trace_state: TraceState | None = None) -> SamplingResult:
            result = self.base.should_sample(parent_context, trace_id, name, kind,
                                             attributes, links, trace_state)
            is_root = not get_current_span(parent_context).get_span_context().is_valid
            if result.decision != Decision.RECORD_AND_SAMPLE and is_root and \
                    any(link.context.trace_flags.sampled for link in links or ()):
                return SamplingResult(Decision.RECORD_AND_SAMPLE,
                                      {**(attributes or {}), "switchyard.detail": False})
            return result

        def get_description(self) -> str:
            return f"FollowLinks{{{self.base.get_description()}}}"

    return FollowLinks(_get_from_env_or_default())
