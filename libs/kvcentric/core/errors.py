"""What a client is told when the conductor turns a request down: the HTTP status, the OpenAI error
type and, for a request refused for load, when to come back. It only maps; the gateway answers.
"""

from __future__ import annotations

from kvcentric.core.openai_api import ApiError
from kvcentric.core.protocol import Rejection


def rejection_error(rejection: Rejection) -> ApiError:
    """503 when no instance can serve the request, 500 when the conductor failed at it (not the client's
    fault), else 429 with a Retry-After of whole seconds, at least 1."""
    if rejection.reason == "no_instance":
        return ApiError(503, rejection.message, kind="service_unavailable")
    if rejection.reason == "bad_request":
        return ApiError(500, f"the conductor failed: {rejection.message}", kind="server_error")
    return ApiError(429, rejection.message, kind="rate_limit_exceeded", code=rejection.reason,
                    headers={"Retry-After": retry_after(rejection.retry_after_s)})


def retry_after(seconds: float) -> str:
    """The Retry-After header for a suggested wait: whole seconds, at least 1."""
    return str(max(1, round(seconds)))
