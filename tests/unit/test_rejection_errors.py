"""What the gateway answers for each reason the conductor turns a request down."""

from __future__ import annotations

from kvcentric.core.errors import rejection_error, retry_after
from kvcentric.core.protocol import Rejection


def test_no_instance_is_503_worth_a_retry():
    error = rejection_error(Rejection(request_id="r1", reason="no_instance", message="no decode instance"))
    assert (error.status, error.kind, error.message, error.headers) == (503, "service_unavailable",
                                                                         "no decode instance", {"Retry-After": "1"})


def test_a_conductor_failure_is_500_not_the_clients_fault():
    error = rejection_error(Rejection(request_id="r1", reason="bad_request", message="boom"))
    assert (error.status, error.kind, error.message) == (500, "server_error", "the conductor failed: boom")


def test_overload_is_429_with_retry_after_and_the_reason_as_code():
    error = rejection_error(Rejection(request_id="r1", reason="overloaded", message="prefill is busy",
                                      retry_after_s=2.6))
    assert (error.status, error.kind, error.code) == (429, "rate_limit_exceeded", "overloaded")
    assert error.headers == {"Retry-After": "3"}


def test_retry_after_is_whole_seconds_and_at_least_one():
    assert [retry_after(s) for s in (0.0, 0.4, 1.6, 10.2)] == ["1", "1", "2", "10"]


def test_what_the_http_layer_refuses_comes_back_in_openai_shape():
    from kvcentric.core.errors import http_error
    missing = http_error(404, "GET", "/v1/nope", 1 << 20)
    assert missing.status == 404 and missing.body()["error"]["type"] == "not_found_error"
    assert http_error(405, "GET", "/v1/completions", 1 << 20).body()["error"]["code"] == "method_not_allowed"
    too_large = http_error(413, "POST", "/v1/completions", 1 << 20)
    assert (too_large.status, too_large.code) == (400, "request_too_large") and "1048576" in too_large.message
    assert http_error(502, "GET", "/x", 1).kind == "server_error"
