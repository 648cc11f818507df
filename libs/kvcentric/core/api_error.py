"""The OpenAI error object every HTTP answer of kvcentric's services uses for a failure, and the check
that raises it. `kvcentric.core.openai_api` re-exports `ApiError`; it holds no validation of its own."""

from __future__ import annotations


class ApiError(Exception):
    """A failure answered as {"error": {"message", "type", "param", "code"}} with its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def check(condition: bool, message: str, param: str | None) -> None:
    """A 400 naming `param` unless `condition` holds."""
    if not condition:
        raise ApiError(400, message, param)
