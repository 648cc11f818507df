"""The engines' trace spans of one request (`prefill.run`, `messenger.transfer`, `decode.queue`,
`decode.generate`), kept open across the chunks and steps a request spans and closed on every ending.

It only records; with tracing off every span is a no-op. The parent of each is the context that came
with the request's submit message (W3C trace context in NATS headers), so one request is one trace.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from kvcentric.runtime import tracing


class RequestSpans:
    def __init__(self) -> None:
        self.parents: dict[str, Context] = {}
        self.open: dict[tuple[str, str], Span] = {}

    def received(self, request_id: str) -> None:
        """Call inside the submit handler: remember the request's trace context."""
        self.parents[request_id] = tracing.capture()

    def start(self, request_id: str, name: str, **attributes) -> Span:
        parent = self.parents.get(request_id)
        span = tracing.start_span(name, parent=parent, attributes={"kvc.request_id": request_id, **attributes})
        self.open[(request_id, name)] = span
        return span

    def get(self, request_id: str, name: str) -> Span:
        return self.open.get((request_id, name), trace.INVALID_SPAN)

    def context(self, request_id: str, name: str):
        """A context whose current span is `name` of this request (for gRPC metadata, child spans)."""
        return trace.set_span_in_context(self.get(request_id, name), self.parents.get(request_id))

    def end(self, request_id: str, name: str, error: str = "", **attributes) -> None:
        span = self.open.pop((request_id, name), None)
        if span is None:
            return
        if attributes:
            span.set_attributes(attributes)
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def first_token(self, request_id: str) -> None:
        """A request computed here from its prompt (a colocated instance) sent its first token: its `prefill.run`
        ends and its `decode.generate` starts (nothing where this instance only prefills or only decodes)."""
        if (request_id, "prefill.run") not in self.open or (request_id, "decode.generate") in self.open:
            return
        self.end(request_id, "prefill.run")
        self.start(request_id, "decode.generate")

    def finish(self, request_id: str, error: str = "") -> None:
        """The request is over here: end whatever of its spans is still open, forget its context."""
        for key in [k for k in self.open if k[0] == request_id]:
            self.end(*key, error=error)
        self.parents.pop(request_id, None)
