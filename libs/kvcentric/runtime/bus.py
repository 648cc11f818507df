"""A service's NATS connection: typed subscribe, publish and request/reply, with W3C trace context in the
headers of every message. It decides nothing about what to send; the service's loop does.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats
import nats.errors

from kvcentric.core.protocol import BadMessage, decode, encode
from kvcentric.runtime import tracing
from kvcentric.runtime.security import NatsAccess, redact_url

NO_RESPONDERS_STATUS = "503"
"""The status header NATS puts on the answer to a request nobody is subscribed to."""

log = logging.getLogger("kvcentric")


class Bus:
    """Typed messaging over one NATS connection; counts what it drops in the service's counters."""

    def __init__(self, instance_id: str, counters: collections.Counter[str], log: logging.Logger) -> None:
        self.instance_id = instance_id
        self.counters = counters
        self.log = log
        self.nc: nats.NATS | None = None
        self._inbox = ""
        self._replies: dict[str, asyncio.Future] = {}
        self._reply_tokens = itertools.count()
        self.on_disconnect: list[Callable[[], Awaitable[None]]] = []
        """Called each time the connection drops (it reconnects by itself, resubscribing; messages published
        to it meanwhile are lost): a service fails what cannot survive the gap."""

    async def connect(self, access: NatsAccess | str, stopping: asyncio.Event) -> None:
        self.nc = await connect_nats(access, self.instance_id, stopping, self._disconnected)

    async def _disconnected(self) -> None:
        self.counters["bus_disconnects_total"] += 1
        for hook in self.on_disconnect:
            await hook()

    async def close(self) -> None:
        """Drain (2 s at most), else close; NATS may already be gone."""
        if self.nc is None or self.nc.is_closed:
            return
        try:
            await asyncio.wait_for(self.nc.drain(), 2.0)
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - closing anyway
            await self.nc.close()

    @property
    def client(self) -> nats.NATS:
        """The connection; only after `connect`."""
        if self.nc is None:
            raise RuntimeError("the bus is not connected")
        return self.nc

    @property
    def max_payload(self) -> int:
        return self.client.max_payload

    async def subscribe(self, subject: str, kind: Any, handler: Callable[[Any], Awaitable[Any]], *,
                        queue: str = "", bad_reply: Callable[[str], msgspec.Struct] | None = None,
                        span_name: str | None = None) -> None:
        """Decode every message on `subject` as `kind` and hand it to `handler`.

        A message that does not decode is logged and counted (bus_drops_total) and, when it asked
        for a reply, answered with `bad_reply(error)`. The handler's return value is the reply.
        A message that carries W3C trace context in its headers is handled inside a span named
        `span_name` (default: the subject without `kvc.`, wildcards and this instance's id, e.g.
        "conductor.schedule", "kvs.query", "prefill.submit"), a child of the sender's span; with an
        explicit `span_name` every message gets a span, a root one when it carries no context.
        """
        name = span_name or default_span_name(subject, self.instance_id)

        async def on_message(msg) -> None:
            try:
                message = decode(msg.data, kind)
            except BadMessage as exc:
                self.counters["bus_drops_total"] += 1
                self.log.warning("dropped a message on %s: %s", msg.subject, exc)
                if msg.reply and bad_reply is not None:
                    await msg.respond(encode(bad_reply(str(exc))))
                return
            try:
                if span_name is not None or tracing.carries_context(msg.headers):
                    with tracing.span(name, tracing.extract_headers(msg.headers), tracing.SpanKind.SERVER,
                                      {"messaging.destination.name": msg.subject}):
                        reply = await handler(message)
                else:
                    reply = await handler(message)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the service
                self.counters["handler_errors_total"] += 1
                self.log.exception("handler for %s failed", msg.subject)
                reply = bad_reply(f"{type(exc).__name__}: {exc}") if bad_reply else None
            if msg.reply and reply is not None:
                await msg.respond(encode(reply))

        await self.client.subscribe(subject, queue=queue, cb=on_message)

    async def subscribe_raw(self, subject: str, **kwargs):
        """A plain nats-py subscription (for a reader that iterates `.messages` itself)."""
        return await self.client.subscribe(subject, **kwargs)

    async def publish(self, subject: str, message, headers: dict | None = None) -> None:
        """Publish `message`; the current trace context (if any) travels in the NATS headers."""
        await self.client.publish(subject, encode(message), headers=tracing.inject_headers(headers))

    async def request(self, subject: str, message, kind, timeout_s: float = 2.0):
        """NATS request/reply with trace context: the reply decoded as `kind`.

        Raises what nats-py raises (nats.errors.NoRespondersError, nats.errors.TimeoutError) and
        BadMessage for a reply that does not decode."""
        reply = await self.client.request(subject, encode(message), timeout=timeout_s,
                                      headers=tracing.inject_headers())
        return decode(reply.data, kind)

    async def send_request(self, subject: str, message) -> asyncio.Future:
        """Publish a request now, before this coroutine yields (so several go out in one write, ahead of
        anything published after them), and return the future of its reply; `reply` awaits it."""
        if not self._inbox:
            self._inbox = self.client.new_inbox()
            await self.client.subscribe(f"{self._inbox}.*", cb=self._on_reply)
        payload, token = encode(message), str(next(self._reply_tokens))
        future = self._replies[token] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: self._replies.pop(token, None))  # answered, or given up on
        try:
            await self.client.publish(subject, payload, reply=f"{self._inbox}.{token}",
                                      headers=tracing.inject_headers())
        except BaseException:
            future.cancel()
            raise
        return future

    async def _on_reply(self, msg) -> None:
        future = self._replies.get(msg.subject.rpartition(".")[2])
        if future is not None and not future.done():
            future.set_result(msg)

    async def reply(self, future: asyncio.Future, kind, timeout_s: float):
        """The reply to a `send_request`, decoded as `kind`; raises as `request` does."""
        try:
            msg = await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise nats.errors.TimeoutError from None
        finally:
            future.cancel()  # no-op once answered
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS_STATUS and not msg.data:
            raise nats.errors.NoRespondersError
        return decode(msg.data, kind)


def default_span_name(subject: str, instance_id: str) -> str:
    """'kvc.conductor.schedule' -> 'conductor.schedule'; 'kvc.prefill.<id>.submit' -> 'prefill.submit'. The
    first token names the service and stays, even when the instance id is that word."""
    tokens = subject.split(".")
    if tokens[0] == "kvc":
        tokens = tokens[1:]
    kept = [t for i, t in enumerate(tokens) if t not in ("*", ">") and (i == 0 or t != instance_id)]
    return ".".join(kept) or subject


async def connect_nats(access: NatsAccess | str, name: str, stopping: asyncio.Event,
                       disconnected: Callable[[], Awaitable[None]] | None = None,
                       patience_s: float = 30.0) -> nats.NATS:
    """Connect (a URL alone: no credentials, no TLS unless tls://), retrying while the server comes up; give up
    after `patience_s` with a clear error, at once when the server refuses the credentials. Once connected it
    reconnects forever (every 0.5 s; a server restarted on its port is found again, every subscription renewed)
    and calls `disconnected` each time the connection drops."""
    access = NatsAccess(access) if isinstance(access, str) else access
    url = redact_url(access.url)
    deadline = time.monotonic() + patience_s

    async def on_error(exc: Exception) -> None:  # one line, not nats-py's default traceback
        log.warning("NATS %s: %s: %s", url, type(exc).__name__, exc)

    async def on_disconnect() -> None:
        if not stopping.is_set():
            log.warning("NATS %s: disconnected, reconnecting", url)
            if disconnected is not None:
                await disconnected()

    async def on_reconnect() -> None:
        log.warning("NATS %s: reconnected", url)

    while True:
        try:
            return await nats.connect(access.url, name=name, connect_timeout=2, max_reconnect_attempts=-1,
                                      reconnect_time_wait=0.5, allow_reconnect=True, error_cb=on_error,
                                      disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
                                      **access.options())
        except Exception as exc:  # noqa: BLE001 - nats raises several kinds while the server starts
            if refused(exc):
                raise ConnectionError(f"NATS at {url} refused {access.user or 'a connection without a user'} "
                                      f"(--nats-user, --nats-password-file, --tls-*): {exc}") from exc
            if stopping.is_set() or time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach NATS at {url} (--nats-url): {exc}") from exc
            await asyncio.sleep(0.25)


def refused(exc: BaseException) -> bool:
    """Whether connecting failed on the credentials or the certificates (trying again would change nothing)."""
    text = str(exc).lower()
    return "authorization violation" in text or "certificate verify failed" in text
