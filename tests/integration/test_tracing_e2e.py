"""One request through a running `kvcentric up` is one trace: every process exports its spans over
OTLP/HTTP to a collector in this test, and the spans of all services share the client's trace id."""

from __future__ import annotations

import json
import os
import secrets
import urllib.request

import pytest

from harness import UpProcess
from test_tracing_exporters import HttpCollector
from waiting import eventually

# The spans of issue 6 and the service that emits each (span names start with their service's short name).
REQUIRED_SPANS = {"gateway.request": "gateway", "conductor.schedule": "conductor", "kvs.query": "kvs-meta",
                  "prefill.run": "prefill", "messenger.transfer": "prefill (its messenger)",
                  "decode.queue": "decode", "decode.generate": "decode"}
SIX_SERVICES = {"gateway", "conductor", "kvs", "prefill", "messenger", "decode"}
PROCESSES = {"kvcentric-gateway", "kvcentric-conductor", "kvcentric-prefill", "kvcentric-decode"}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A cluster of its own (own NATS and Redis) whose every process exports spans to the collector."""
    collector = HttpCollector()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_BSP_SCHEDULE_DELAY": "100"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        up = UpProcess(str(tmp_path_factory.mktemp("traced")))
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    try:
        yield up, collector
    finally:
        up.stop()
        collector.close()


def complete(url: str, traceparent: str) -> dict:
    body = {"model": "tiny", "prompt": "one request, one trace, across every process", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "traceparent": traceparent})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


class Trace(list):
    """The spans of one trace, shown as the (service, name) pairs they hold."""

    def __repr__(self) -> str:
        return repr(sorted({(s["service"], s["name"]) for s in self}))

    def whole(self) -> bool:
        """Every process and every required span has reported, and no span waits for its parent."""
        known = {s["span_id"] for s in self} | {s["parent_id"] for s in self if s["name"] == "gateway.request"}
        return PROCESSES <= {s["service"] for s in self} and REQUIRED_SPANS.keys() <= {s["name"] for s in self} \
            and all(s["parent_id"] in known for s in self)


def wait_for_trace(collector: HttpCollector, trace_id: str, timeout_s: float = 20.0) -> list[dict]:
    """The trace's spans once every process has exported its part (exports are batched, 100 ms here)."""
    return eventually(lambda: Trace(s for s in collector.snapshot() if s["trace_id"] == trace_id),
                      f"every span of trace {trace_id}", until=Trace.whole, timeout_s=timeout_s, every_s=0.1)


def test_one_request_is_one_trace_across_all_services(traced):
    up, collector = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    assert complete(up.url, f"00-{trace_id}-{client_span}-01")["usage"]["completion_tokens"] == 4
    spans = wait_for_trace(collector, trace_id)
    services = {s["service"] for s in spans}
    assert PROCESSES <= services, f"spans of trace {trace_id} came only from {sorted(services)}"
    root = next(s for s in spans if s["name"] == "gateway.request")
    assert root["parent_id"] == client_span  # the client's W3C traceparent header was honoured
    ids = {s["span_id"] for s in spans} | {client_span}
    assert all(s["parent_id"] in ids for s in spans), "every span hangs off another span of the same trace"
    names = {s["name"] for s in spans}
    missing = [f"{name} ({service})" for name, service in REQUIRED_SPANS.items() if name not in names]
    assert not missing, f"one trace holds {sorted(names)} from {sorted(services)}; missing: {', '.join(missing)}"
    assert {name.split(".")[0] for name in names} >= SIX_SERVICES
