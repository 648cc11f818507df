"""The lifecycle every service shares: connect to NATS, serve /health and /metrics, own background
tasks, carry trace context on every bus message, and stop cleanly on SIGINT/SIGTERM. Services subclass
it and fill in start/stop; it holds no policy of its own.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import secrets
import signal
import time
from typing import Awaitable, Callable

import nats
from aiohttp import web

from kvcentric.runtime import tracing
from kvcentric.config import BusConfig
from kvcentric.core.metrics import LATENCY_BUCKETS_S, Histogram, render
from kvcentric.core.protocol import BadMessage, decode, encode

NO_RESPONDERS_STATUS = "503"
"""The status header NATS puts on the answer to a request nobody is subscribed to."""

log = logging.getLogger("kvcentric")


class Service:
    role = "service"

    def __init__(self, config: BusConfig) -> None:
        self.config = config
        self.instance_id = config.instance_id or f"{self.role}-{secrets.token_hex(3)}"
        self.log = logging.getLogger(f"kvcentric.{self.role}")
        self.counters: collections.Counter[str] = collections.Counter()
        self.stopping = asyncio.Event()
        self.ready = False
        self.nc: nats.NATS | None = None
        self.http_port = 0
        self._tasks: set[asyncio.Task] = set()
        self._http: web.AppRunner | None = None
        self._histograms: dict[str, Histogram] = {}
        self._inbox = ""
        self._replies: dict[str, asyncio.Future] = {}
        self._reply_tokens = itertools.count()

    # ---------------------------------------------------------------- for subclasses

    async def start(self) -> None:
        """Subscribe, start servers and loops. Called once NATS is connected."""

    async def stop(self) -> None:
        """Release what start() took. Called after the stop event, before NATS is drained."""

    def add_routes(self, app: web.Application) -> None:
        """Extra HTTP routes besides /health and /metrics."""

    def health(self) -> dict:
        return {}

    def gauges(self) -> dict[str, float]:
        return {}

    @property
    def hands_over(self) -> bool:
        """Another service goes on in this process once this one stops (see `run_service`)."""
        return False

    def successor(self) -> "Service | None":
        """The service this process runs next, once this one has stopped (None: the process ends)."""
        return None

    # ---------------------------------------------------------------- lifecycle

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        await self.open()
        try:
            await self.stopping.wait()
        finally:
            await self.close()

    async def open(self) -> None:
        tracing.setup(self.role, self.instance_id)
        self.nc = await connect_nats(self.config.nats_url, self.instance_id, self.stopping)
        await self._start_http()
        await self.start()
        self.ready = True
        self.log.info("%s %s ready: http://%s:%d", self.role, self.instance_id, self.config.host, self.http_port)

    async def close(self) -> None:
        self.ready = False
        self.stopping.set()
        await self.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), 2.0)
            except (Exception, asyncio.CancelledError):  # noqa: BLE001 - NATS may be gone; closing anyway
                await self.nc.close()
        if self._http is not None:
            await self._http.cleanup()
        if not self.hands_over:  # the tracer is the process's; the next service goes on with it
            await asyncio.get_running_loop().run_in_executor(None, tracing.shutdown)

    def spawn(self, coro: Awaitable, name: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def every(self, period_s: float, action: Callable[[], Awaitable[None]]) -> None:
        """Run `action` every period until stopping; an exception is logged, not fatal."""
        while not self.stopping.is_set():
            try:
                await action()
            except Exception:  # noqa: BLE001 - a periodic job must survive one failure
                self.log.exception("periodic %s failed", getattr(action, "__name__", action))
            try:
                await asyncio.wait_for(self.stopping.wait(), period_s)
            except asyncio.TimeoutError:
                pass

    # ---------------------------------------------------------------- bus

    async def subscribe(self, subject: str, kind, handler, *, queue: str = "",
                        bad_reply: Callable[[str], object] | None = None, span_name: str | None = None) -> None:
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

        await self.nc.subscribe(subject, queue=queue, cb=on_message)

    async def publish(self, subject: str, message, headers: dict | None = None) -> None:
        """Publish `message`; the current trace context (if any) travels in the NATS headers."""
        await self.nc.publish(subject, encode(message), headers=tracing.inject_headers(headers))

    async def request(self, subject: str, message, kind, timeout_s: float = 2.0):
        """NATS request/reply with trace context: the reply decoded as `kind`.

        Raises what nats-py raises (nats.errors.NoRespondersError, nats.errors.TimeoutError) and
        BadMessage for a reply that does not decode."""
        reply = await self.nc.request(subject, encode(message), timeout=timeout_s,
                                      headers=tracing.inject_headers())
        return decode(reply.data, kind)

    async def send_request(self, subject: str, message) -> asyncio.Future:
        """Publish a request now, before this coroutine yields (so several go out in one write, ahead of
        anything published after them), and return the future of its reply; `reply` awaits it."""
        if not self._inbox:
            self._inbox = self.nc.new_inbox()
            await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)
        payload, token = encode(message), str(next(self._reply_tokens))
        future = self._replies[token] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: self._replies.pop(token, None))  # answered, or given up on
        try:
            await self.nc.publish(subject, payload, reply=f"{self._inbox}.{token}", headers=tracing.inject_headers())
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
        except asyncio.TimeoutError:
            raise nats.errors.TimeoutError from None
        finally:
            future.cancel()  # no-op once answered
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS_STATUS and not msg.data:
            raise nats.errors.NoRespondersError
        return decode(msg.data, kind)

    # ---------------------------------------------------------------- metrics

    def histogram(self, name: str, buckets=LATENCY_BUCKETS_S, help: str = "") -> Histogram:
        """The histogram `name` (exposed as kvc_<name> on /metrics), made on first use with `buckets`."""
        histogram = self._histograms.get(name)
        if histogram is None:
            histogram = self._histograms[name] = Histogram(buckets, help)
        return histogram

    # ---------------------------------------------------------------- http

    async def _start_http(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.add_routes(app)
        self._http = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._http.setup()
        site = web.TCPSite(self._http, self.config.host, self.config.port)
        await site.start()
        self.http_port = site._server.sockets[0].getsockname()[1]

    async def _health(self, request: web.Request) -> web.Response:
        body = {"status": "ok" if self.ready else "starting", "role": self.role,
                "instance_id": self.instance_id, "cluster": self.config.cluster, **self.health()}
        return web.json_response(body, status=200 if self.ready else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = render({"role": self.role, "instance": self.instance_id}, self.counters, self.gauges(),
                      self._histograms)
        return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def default_span_name(subject: str, instance_id: str) -> str:
    """'kvc.conductor.schedule' -> 'conductor.schedule'; 'kvc.prefill.<id>.submit' -> 'prefill.submit'."""
    tokens = subject.split(".")
    if tokens[0] == "kvc":
        tokens = tokens[1:]
    return ".".join(t for t in tokens if t not in ("*", ">", instance_id)) or subject


async def connect_nats(url: str, name: str, stopping: asyncio.Event, patience_s: float = 30.0) -> nats.NATS:
    """Connect, retrying while the server comes up; give up after `patience_s` with a clear error."""
    deadline = time.monotonic() + patience_s

    async def on_error(exc: Exception) -> None:  # one line, not nats-py's default traceback
        log.warning("NATS %s: %s: %s", url, type(exc).__name__, exc)

    async def on_disconnect() -> None:
        if not stopping.is_set():
            log.warning("NATS %s: disconnected, reconnecting", url)

    while True:
        try:
            return await nats.connect(url, name=name, connect_timeout=2, max_reconnect_attempts=-1,
                                      reconnect_time_wait=0.5, allow_reconnect=True, error_cb=on_error,
                                      disconnected_cb=on_disconnect)
        except Exception as exc:  # noqa: BLE001 - nats raises several kinds while the server starts
            if stopping.is_set() or time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach NATS at {url} (--nats-url): {exc}") from exc
            await asyncio.sleep(0.25)


def run_service(service: Service) -> None:
    """Run until SIGINT/SIGTERM, on uvloop when it is installed (KVC_EVENT_LOOP=asyncio to opt out).

    A stopped service may hand over to its `successor` in the same process (an engine's role change); a
    signal ends the process."""
    logging.basicConfig(level=service.config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loop_factory = None
    if os.environ.get("KVC_EVENT_LOOP", "uvloop") == "uvloop":
        try:
            import uvloop
            loop_factory = uvloop.new_event_loop
        except ImportError:
            pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        while service is not None:
            runner.run(service.run())
            service = service.successor()
