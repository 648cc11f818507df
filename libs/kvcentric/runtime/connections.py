"""Bounds on the connections of one HTTP server: how long a client may take to send a request, and how many
connections may be open at once, so that slow or silent clients cannot hold the process's file descriptors.

At the cap the oldest idle connection (no request in progress: silent, half a request head, or kept alive)
is closed to make room; only when every connection is busy does a newcomer get a 503 in OpenAI's error
shape. It bounds connections; what a request means is the handlers' business.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import resource
from collections.abc import Callable
from typing import cast

from aiohttp import web

from kvcentric.core.openai_api import ApiError

FD_RESERVE = 128
"""File descriptors kept out of the connection cap for everything else the process opens (NATS, Redis,
gRPC, logs), so that a full cap never leaves the process unable to open one."""
LINGER_S = 1.0
"""How long a connection stays open after an answer sent before the body was all read (aiohttp reads and
drops the rest meanwhile, so the client reads the answer before the close); its default is 10 s, which a
slow body would hold on to. A refused connection stays this long after its 503."""
REFUSALS_LINGERING = FD_RESERVE // 2
"""Most refused connections left open at once for their client to read the 503 (beyond, closed at once)."""


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """How long a client may take and how many connections a server keeps; see docs/operations.md."""

    header_timeout_s: float = 15.0
    """A connection that has not sent a whole request head this long after it opened or after its last
    answer is closed (silent clients, half-sent heads, idle keep-alive)."""
    body_timeout_s: float = 30.0
    """A request whose body has not all arrived this long after its head gets a 408 and the connection
    is closed."""
    max_connections: int = 4096
    """Most connections open at once (further capped by the open-file limit, less FD_RESERVE)."""

    @property
    def connection_cap(self) -> int:
        """`max_connections`, or fewer where the process may not open that many files."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft - FD_RESERVE))


def refusal_bytes() -> bytes:
    """The whole HTTP answer of a connection over the cap: 503, JSON error body, Retry-After, close."""
    error = ApiError(503, "the server has too many open connections; retry shortly", kind="service_unavailable",
                     code="too_many_connections")
    body = json.dumps(error.body()).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class Refusal(asyncio.Protocol):
    """A connection over the cap: answered with the 503 at once and closed once the client's request has
    come in (closing on unread input would reset the connection and could lose the 503), or after
    LINGER_S, or at once when `lingering` already holds REFUSALS_LINGERING (their descriptors are outside
    the cap)."""

    def __init__(self, lingering: set[Refusal]) -> None:
        self.lingering = lingering
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.transport.write(refusal_bytes())
        if len(self.lingering) >= REFUSALS_LINGERING:
            self.transport.close()
            return
        self.lingering.add(self)
        asyncio.get_running_loop().call_later(LINGER_S, self.close)

    def data_received(self, data: bytes) -> None:
        if b"\r\n\r\n" in data:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lingering.discard(self)

    def close(self) -> None:
        self.lingering.discard(self)
        if self.transport is not None:
            self.transport.close()


class JsonErrorHandler(web.RequestHandler):
    """aiohttp's connection handler, except that what it answers itself, before any middleware (a request
    head it cannot parse, a header line too long), is an OpenAI error object too, not a plain-text page."""

    __slots__ = ("on_lost",)

    def __init__(self, *args, on_lost: Callable[[JsonErrorHandler], None], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.on_lost = on_lost

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        self.on_lost(self)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises if an answer has begun
        if status < 500:
            first_line = (message or "malformed HTTP").splitlines()[0]
            error = ApiError(status, f"the request could not be read: {first_line}")
        else:
            error = ApiError(status, "internal error while handling the request", kind="server_error")
        response = web.json_response(error.body(), status=status)
        response.force_close()
        return response


class ConnectionCap:
    """The listening socket's protocol factory: aiohttp's request handler (`JsonErrorHandler`, made with
    `handler_args`) while there is room, else room made by closing the oldest idle connection, else a
    `Refusal`."""

    def __init__(self, server: web.Server, handler_args: dict, cap: int, counters: collections.Counter[str]) -> None:
        self.server, self.handler_args, self.cap, self.counters = server, handler_args, cap, counters
        self.busy: collections.Counter[object] = collections.Counter()
        """Requests in progress per connection (its aiohttp handler), kept by `HttpServer`'s middleware."""
        self.refusing: set[Refusal] = set()
        self.open: dict[JsonErrorHandler, None] = {}
        """The connections open, oldest first (those closed to make room leave at once)."""

    def __call__(self) -> asyncio.BaseProtocol:
        if len(self.open) >= self.cap and not self.close_oldest_idle():
            self.counters["http_connections_refused_total"] += 1
            return Refusal(self.refusing)
        handler = JsonErrorHandler(self.server, loop=asyncio.get_running_loop(), on_lost=self.forget,
                                   **self.handler_args)
        self.open[handler] = None
        return handler

    def forget(self, handler: JsonErrorHandler) -> None:
        self.open.pop(handler, None)

    def close_oldest_idle(self) -> bool:
        """Close the connection open longest that has no request in progress; False when all are busy."""
        for handler in self.open:  # in the order they opened
            if not self.busy[handler]:
                del self.open[handler]  # it is closing: out of the count now, not when its close is done
                handler.force_close()
                self.counters["http_connections_evicted_total"] += 1
                return True
        return False

    def counting(self, handler: object) -> Callable[[], None]:
        """Mark one request in progress on `handler`; the returned function unmarks it."""
        self.busy[handler] += 1

        def done() -> None:
            self.busy[handler] -= 1
            if self.busy[handler] <= 0:
                del self.busy[handler]
        return done

