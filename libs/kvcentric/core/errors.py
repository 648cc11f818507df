"""What a client is told when the conductor turns a request down: the HTTP status, the OpenAI error
type and, for a request refused for load, when to come back. It only maps; the gateway answers.
"""

from __future__ import annotations

from kvcentric.core.openai_api import ApiError
from kvcentric.core.protocol import Rejection


def rejection_error(rejection: Rejection) -> ApiError:
    """503 when no instance can serve the request (Retry-After 1: a dead instance is restarted in seconds),
    500 when the conductor failed at it (not the client's fault), else 429 with a Retry-After of whole
    seconds, at least 1."""
    if rejection.reason == "no_instance":
        return ApiError(503, rejection.message, kind="service_unavailable", headers={"Retry-After": "1"})
    if rejection.reason == "bad_request":
        return ApiError(500, f"the conductor failed: {rejection.message}", kind="server_error")
    return ApiError(429, rejection.message, kind="rate_limit_exceeded", code=rejection.reason,
                    headers={"Retry-After": retry_after(rejection.retry_after_s)})


def retry_after(seconds: float) -> str:
    """The Retry-After header for a suggested wait: whole seconds, at least 1."""
    return str(max(1, round(seconds)))


def http_error(status: int, method: str, path: str, max_body_bytes: int) -> ApiError:
    """The OpenAI-shaped answer for what the HTTP layer refuses before any handler runs: an unknown path
    (404), a method the path does not take (405), a body over the limit (a 400 `request_too_large`, the
    client's mistake, as a request too large for the bus is), anything else by its status."""
    if status == 404:
        return ApiError(404, f"no such endpoint: {method} {path}", kind="not_found_error", code="not_found")
    if status == 405:
        return ApiError(405, f"{path} does not take {method}", kind="invalid_request_error",
                        code="method_not_allowed")
    if status == 413:
        return ApiError(400, f"the request body is over the gateway's limit of {max_body_bytes} bytes",
                        code="request_too_large")
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return ApiError(status, f"{method} {path} failed with HTTP {status}", kind=kind)
