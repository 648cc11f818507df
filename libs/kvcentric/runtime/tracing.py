"""OpenTelemetry tracing for every kvcentric process: set-up from the standard OTEL_* variables and W3C
trace-context carriers for NATS headers and gRPC metadata; it makes spans only when a caller asks.

With nothing configured (no OTLP endpoint, `OTEL_TRACES_EXPORTER=none` or `OTEL_SDK_DISABLED=true`) the
OpenTelemetry API stays a no-op: spans cost a few microseconds and nothing is exported or injected.

How a service traces its work (the `Service` base class already does the bus part for every message):

    with tracing.span("prefill.run", parent=ctx, attributes={"kvc.request_id": rid}) as span:
        span.add_event("chunk", {"tokens": 512})

    span = tracing.start_span("decode.queue", parent=ctx)   # a span that outlives a block
    ...; span.end()

    stub.PushKV(chunks, metadata=tracing.inject_metadata())           # gRPC client
    ctx = tracing.extract_metadata(context.invocation_metadata())     # gRPC server
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from kvcentric.config import ConfigError

__all__ = ["Context", "Span", "SpanKind", "TracingConfigError", "capture", "carries_context", "exporter_kind",
           "extract_headers", "extract_metadata", "inject_headers", "inject_metadata", "otlp_protocol",
           "service_name", "setup", "shutdown", "span", "start_span", "tracer"]

EXPORTERS = ("otlp", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")
_provider = None


class TracingConfigError(ConfigError):
    """A bad OTEL_* setting; the message names the variable."""


# ---------------------------------------------------------------- set-up


def exporter_kind(env: Mapping[str, str]) -> str | None:
    """'otlp' or 'console' when spans should be exported, None when tracing stays a no-op."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    chosen = env.get("OTEL_TRACES_EXPORTER")
    if chosen is None:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return "otlp" if endpoint else None
    name = chosen.split(",")[0].strip().lower()
    if name not in EXPORTERS:
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={chosen!r}: choose one of {', '.join(EXPORTERS)}")
    return None if name == "none" else name


def otlp_protocol(env: Mapping[str, str]) -> str:
    """The OTLP transport: 'grpc' (the default of the Python SDK, port 4317) or 'http/protobuf' (4318)."""
    variable = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" if env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") \
        else "OTEL_EXPORTER_OTLP_PROTOCOL"
    protocol = env.get(variable) or "grpc"
    if protocol not in PROTOCOLS:
        raise TracingConfigError(f"{variable}={protocol!r}: choose one of {', '.join(PROTOCOLS)}")
    return protocol


def service_name(role: str, env: Mapping[str, str]) -> str:
    return env.get("OTEL_SERVICE_NAME") or f"kvcentric-{role}"


def _exporter(kind: str, env: Mapping[str, str]):
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    if otlp_protocol(env) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        return GrpcExporter()  # endpoint, headers, timeout, compression: from the OTEL_* variables
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
    return HttpExporter()


def setup(role: str, instance_id: str = "", env: Mapping[str, str] | None = None) -> bool:
    """Install an exporting tracer provider once per process; False (and a no-op API) when not configured."""
    global _provider
    env = os.environ if env is None else env
    if _provider is not None:
        return True
    kind = exporter_kind(env)
    if kind is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": service_name(role, env)}
    if instance_id:
        attributes["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(_exporter(kind, env)))
    trace.set_tracer_provider(provider)
    _provider = provider
    return True


def shutdown(timeout_s: float = 2.0) -> None:
    """Export what is buffered and stop the exporter (a process calls it once, on its way out)."""
    global _provider
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))
        _provider.shutdown()
        _provider = None


# ---------------------------------------------------------------- spans


def tracer() -> trace.Tracer:
    return trace.get_tracer("kvcentric")


@contextlib.contextmanager
def span(name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
         attributes: dict | None = None) -> Iterator[Span]:
    """A span that is current inside the block (so bus messages sent there carry it); an exception
    escaping the block is recorded on it. Without an exporter and a traced parent it is a no-op."""
    if _provider is None and not trace.get_current_span(parent).get_span_context().is_valid:
        yield trace.INVALID_SPAN
        return
    with tracer().start_as_current_span(name, context=parent, kind=kind, attributes=attributes) as current:
        yield current


def start_span(name: str, parent: Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
               attributes: dict | None = None) -> Span:
    """A span the caller ends itself (`span.end()`), for work that outlives one block of code."""
    return tracer().start_span(name, context=parent, kind=kind, attributes=attributes)


def capture() -> Context:
    """The current context, to be used later as `parent=` when the work continues elsewhere (a queue)."""
    return otel_context.get_current()


# ---------------------------------------------------------------- carriers


def inject_headers(headers: Mapping[str, str] | None = None, parent: Context | None = None) -> dict | None:
    """NATS headers carrying the current (or given) trace context; None when there is nothing to send."""
    if not trace.get_current_span(parent).get_span_context().is_valid:  # the common, untraced case: fast
        return dict(headers) if headers else None
    carrier = dict(headers or {})
    propagate.inject(carrier, context=parent)
    return carrier or None


def extract_headers(headers: Mapping[str, str] | None) -> Context:
    """The trace context that NATS headers (or HTTP headers) carry; an empty context when none."""
    return propagate.extract(headers or {})


def inject_metadata(metadata: Iterable[tuple[str, str]] = (), parent: Context | None = None) -> list:
    """gRPC metadata (a list of (key, value) tuples) with the current trace context appended."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=parent)
    return [*metadata, *carrier.items()]


def extract_metadata(metadata: Iterable | None) -> Context:
    """The trace context in gRPC invocation metadata (the server side's `context.invocation_metadata()`)."""
    carrier = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    return propagate.extract(carrier)


def carries_context(headers: Mapping[str, str] | None) -> bool:
    return headers is not None and "traceparent" in headers
