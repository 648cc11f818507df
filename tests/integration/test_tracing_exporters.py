"""Spans leave a process over OTLP/gRPC and OTLP/HTTP-protobuf, as the OTEL_* variables choose, and arrive
at real collectors (an OTLP HTTP endpoint and an OTLP gRPC TraceService run by this test)."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvcentric.runtime import tracing
from kvcentric.tools.processes import free_port


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict]:
    """Flat span dicts: service, name, trace id, span id, parent id, attributes, event names."""
    found = []
    for resource_spans in request.resource_spans:
        attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found.append({"service": attributes.get("service.name", ""), "name": span.name,
                              "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                              "parent_id": span.parent_span_id.hex(),
                              "attributes": {a.key: a.value for a in span.attributes},
                              "events": [e.name for e in span.events]})
    return found


class HttpCollector:
    """An OTLP/HTTP (protobuf) endpoint on a free port, in a thread of its own: POST /v1/traces."""

    def __init__(self) -> None:
        self.port = free_port()
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise AssertionError(f"the OTLP/HTTP collector did not start on port {self.port} in 10 s")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/traces", self._receive)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    async def _receive(self, request: web.Request) -> web.Response:
        message = trace_service_pb2.ExportTraceServiceRequest.FromString(await request.read())
        with self._lock:
            self.spans += spans_of(message)
        reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.spans)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class GrpcCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):  # noqa: N802 - the gRPC method name
        self.spans += spans_of(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def export_one_span(kind: str, env: dict) -> None:
    """Build the exporter the variables ask for and send one span through it (a local provider, so the
    process-wide one stays untouched)."""
    provider = TracerProvider(resource=Resource.create({"service.name": tracing.service_name("gateway", env)}))
    provider.add_span_processor(SimpleSpanProcessor(tracing._exporter(kind, env)))
    with provider.get_tracer("test").start_as_current_span("gateway.request") as span:
        span.add_event("first_token")
    provider.shutdown()


def test_spans_go_out_over_otlp_grpc(monkeypatch):
    collector = GrpcCollector()
    try:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}"}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert tracing.exporter_kind(env) == "otlp" and tracing.otlp_protocol(env) == "grpc"
        export_one_span("otlp", env)
    finally:
        collector.server.stop(1)
    assert [(s["service"], s["name"], s["events"]) for s in collector.spans] == [
        ("kvcentric-gateway", "gateway.request", ["first_token"])]


def test_spans_go_out_over_otlp_http_protobuf(monkeypatch):
    collector = HttpCollector()
    try:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_SERVICE_NAME": "front-door"}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        export_one_span("otlp", env)
        spans = collector.snapshot()
    finally:
        collector.close()
    assert [(s["service"], s["name"]) for s in spans] == [("front-door", "gateway.request")]
