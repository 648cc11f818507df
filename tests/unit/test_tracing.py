"""Tracing set-up from OTEL_* variables and W3C trace-context carriers (NATS headers, gRPC metadata)."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvcentric.runtime import tracing
from kvcentric.runtime.bus import default_span_name


@pytest.mark.parametrize("env, kind", [
    ({}, None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"}, "otlp"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://x:4318/v1/traces"}, "otlp"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_TRACES_EXPORTER": "none"}, None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "true"}, None),
    ({"OTEL_TRACES_EXPORTER": "console"}, "console"),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, "otlp"),
])
def test_tracing_is_on_only_when_an_exporter_is_configured(env, kind):
    assert tracing.exporter_kind(env) == kind


def test_unknown_exporters_and_protocols_name_the_variable():
    with pytest.raises(tracing.TracingConfigError, match="OTEL_TRACES_EXPORTER"):
        tracing.exporter_kind({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(tracing.TracingConfigError, match="OTEL_EXPORTER_OTLP_PROTOCOL"):
        tracing.otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_the_protocol_defaults_to_grpc_and_the_traces_variable_wins():
    assert tracing.otlp_protocol({}) == "grpc"
    assert tracing.otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    assert tracing.otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}) == "grpc"


def test_service_name_defaults_to_kvcentric_role():
    assert tracing.service_name("gateway", {}) == "kvcentric-gateway"
    assert tracing.service_name("gateway", {"OTEL_SERVICE_NAME": "front"}) == "front"


def test_setup_without_configuration_is_a_no_op():
    assert tracing.setup("gateway", env={}) is False
    assert tracing.inject_headers() is None  # nothing to carry, so NATS sends no headers


def test_bus_span_names_come_from_the_subject():
    assert default_span_name("kvc.conductor.schedule", "c-1") == "conductor.schedule"
    assert default_span_name("kvc.kvs.query", "k") == "kvs.query"
    assert default_span_name("kvc.prefill.prefill-0.submit", "prefill-0") == "prefill.submit"
    assert default_span_name("kvc.req.*.cancel", "x") == "req.cancel"
    assert default_span_name("kvc.conductor.schedule", "conductor") == "conductor.schedule"  # an id like the role


@pytest.fixture
def spans(monkeypatch):
    """A recording tracer provider for this test only (the global one stays a no-op)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "_provider", provider)
    return exporter


def test_context_crosses_nats_headers_and_grpc_metadata(spans):
    with tracing.span("gateway.request") as root:
        headers = tracing.inject_headers({"x": "1"})
        metadata = tracing.inject_metadata([("a", "b")])
    trace_id = root.get_span_context().trace_id
    assert headers["x"] == "1" and headers["traceparent"].split("-")[1] == f"{trace_id:032x}"
    assert metadata[0] == ("a", "b") and metadata[1][0] == "traceparent"
    assert tracing.carries_context(headers)
    with tracing.span("conductor.schedule", parent=tracing.extract_headers(headers)) as child:
        pass
    with tracing.span("messenger.transfer", parent=tracing.extract_metadata(metadata)):
        pass
    finished = spans.get_finished_spans()
    assert {s.context.trace_id for s in finished} == {trace_id}
    by_name = {s.name: s for s in finished}
    assert by_name["conductor.schedule"].parent.span_id == root.get_span_context().span_id
    assert by_name["messenger.transfer"].parent.span_id == root.get_span_context().span_id
    assert child.get_span_context().trace_id == trace_id


def test_a_captured_context_parents_a_span_started_later(spans):
    with tracing.span("prefill.submit") as submit:
        saved = tracing.capture()
    later = tracing.start_span("prefill.run", parent=saved)
    later.add_event("chunk", {"tokens": 16})
    later.end()
    run = [s for s in spans.get_finished_spans() if s.name == "prefill.run"][0]
    assert run.parent.span_id == submit.get_span_context().span_id and run.events[0].name == "chunk"


def test_without_an_exporter_spans_and_injection_cost_nothing():
    with tracing.span("gateway.request") as span:
        assert span is trace.INVALID_SPAN and tracing.inject_headers({"a": "b"}) == {"a": "b"}


def test_an_empty_carrier_extracts_no_parent():
    assert not trace.get_current_span(tracing.extract_headers(None)).get_span_context().is_valid
    assert not trace.get_current_span(tracing.extract_metadata(None)).get_span_context().is_valid
