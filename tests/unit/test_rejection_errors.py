"""What the gateway answers for each reason the conductor turns a request down."""

from __future__ import annotations

from kvcentric.core.errors import rejection_error, retry_after
from kvcentric.core.protocol import Rejection


def test_no_instance_is_503():
    error = rejection_error(Rejection(request_id="r1", reason="no_instance", message="no decode instance"))
    assert (error.status, error.kind, error.message, error.headers) == (503, "service_unavailable",
                                                                         "no decode instance", {})


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
