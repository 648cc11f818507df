"""A colocated instance traces its compute as the disaggregated engines do: the submit opens `prefill.run`
under the request's trace, its first token sent ends it and opens `decode.generate`, its last chunk ends that."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from factories import greedy
from kvcentric.core.protocol import PrefillJob, TokenChunk
from kvcentric.engine.config import EngineConfig
from kvcentric.runtime import tracing


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "_provider", provider)
    return exporter


def test_a_colocated_request_has_prefill_and_decode_spans_in_its_trace(spans):
    from kvc_colocated.service import ColocatedService

    service = ColocatedService(EngineConfig(instance_id="colocated-0", num_kv_blocks=16, calibrate=False))
    job = PrefillJob(request_id="r1", token_ids=[256, 72, 105], sampling=greedy(3), decode_id="colocated-0",
                     decode_kv_addr="")
    try:
        with tracing.span("prefill.submit") as submit:
            assert asyncio.run(service.on_prefill(job)).ok
        service.outbox.emit([TokenChunk(request_id="r1", seq=0, token_ids=[65])])
        service.outbox.emit([TokenChunk(request_id="r1", seq=1, token_ids=[66], finish_reason="length")])
    finally:
        service.model.close()
    finished = {span.name: span for span in spans.get_finished_spans()}
    assert {"prefill.run", "decode.generate"} <= set(finished)
    trace_id = submit.get_span_context().trace_id
    assert finished["prefill.run"].context.trace_id == finished["decode.generate"].context.trace_id == trace_id
    assert finished["prefill.run"].end_time <= finished["decode.generate"].start_time
    assert not service.spans.open
