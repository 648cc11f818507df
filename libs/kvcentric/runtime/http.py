"""A service's HTTP side: /health, /metrics and the routes a service adds, on one aiohttp server.

What /health says comes from a callback the service gives (status code and body); every error, whatever
raised it, is answered as an OpenAI error object. This module renders no policy of its own.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import resource
import ssl
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from aiohttp import web

from kvcentric.core.errors import http_error
from kvcentric.core.metrics import LATENCY_BUCKETS_S, Histogram, labelled, render
from kvcentric.core.openai_api import ApiError
from kvcentric.runtime.connections import LINGER_S, ConnectionCap, HttpLimits


class Metrics:
    """A service's counters, histograms and gauges, rendered as Prometheus text with role/instance labels; and,
    once `vllm_labels` names the model (`model_name`), the series a vLLM server would expose under vLLM's
    names (`vllm:...`), for dashboards and autoscalers written for vLLM."""

    def __init__(self, role: str, instance_id: str, gauges: Callable[[], dict[str, float]] = dict) -> None:
        self.labels = {"role": role, "instance": instance_id}
        self.counters: collections.Counter[str] = collections.Counter()
        self.histograms: dict[str, Histogram] = {}
        self.gauges = gauges
        self.vllm_labels: dict[str, str] = {}
        """{"model_name": ...}: set by a service that exposes vLLM-named series (none until then)."""
        self.vllm_counters: collections.Counter[str] = collections.Counter()
        self.vllm_histograms: dict[str, Histogram] = {}
        self.vllm_gauges: Callable[[], dict[str, float]] = dict

    def histogram(self, name: str, buckets=LATENCY_BUCKETS_S, help: str = "") -> Histogram:
        """The histogram `name` (exposed as kvc_<name> on /metrics), made on first use with `buckets`."""
        histogram = self.histograms.get(name)
        if histogram is None:
            histogram = self.histograms[name] = Histogram(buckets, help)
        return histogram

    def render(self) -> str:
        text = render(self.labels, self.counters, {**process_gauges(), **self.gauges()}, self.histograms)
        if self.vllm_labels:
            text += render({**self.vllm_labels, **self.labels}, self.vllm_counters, self.vllm_gauges(),
                           self.vllm_histograms, prefix="vllm:")
        return text


def process_gauges() -> dict[str, float]:
    """The process's garbage collector: the objects `freeze_heap` took out of its sight, and its full
    collections so far (each one stops every thread of the process while it walks the heap); and its minor page
    faults so far (each a kernel entry and a zeroed page: what `keep_heap` keeps a model step from taking)."""
    return {"gc_frozen_objects": gc.get_freeze_count(), "gc_full_collections": gc.get_stats()[2]["collections"],
            "minor_page_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt}


MAX_BODY_BYTES = 1 << 20
"""Largest request body a service reads (aiohttp's default, made explicit so errors can name it)."""
RETRY_AFTER_S = "1"
"""Retry-After of a 503 for a dependency that is down: soon, a restart or a reconnect is usually quick."""

HealthView = Callable[[], Awaitable[tuple[int, dict]]]
"""async () -> (HTTP status, JSON body) of GET /health or GET /ready."""

BUS_DOWN = (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError,
            nats.errors.ConnectionReconnectingError, nats.errors.NoServersError, nats.errors.StaleConnectionError,
            nats.errors.OutboundBufferLimitError, nats.errors.NoRespondersError, nats.errors.TimeoutError,
            nats.errors.FlushTimeoutError, nats.errors.DrainTimeoutError)
"""What nats-py raises when the bus, or whoever should answer on it, is not there (not a bug here)."""


def store_down(exc: BaseException) -> bool:
    """Whether `exc` is what redis-py raises when Redis does not answer (BusyLoadingError, a restart's replay, is
    one). A service that never imported redis-py (every one but kvs-meta) cannot hold one of its errors, so it is
    not imported here: that import (redis-py loads OpenTelemetry's metrics SDK) costs each service half a second
    of start-up."""
    exceptions = sys.modules.get("redis.exceptions")
    return exceptions is not None and isinstance(exc, (exceptions.ConnectionError, exceptions.TimeoutError))


def unavailable(exc: BaseException) -> str:
    """The dependency `exc` says is unavailable ("NATS", "Redis", "a dependency"), else ""."""
    if isinstance(exc, BUS_DOWN):
        return "NATS"
    if store_down(exc):
        return "Redis"
    if isinstance(exc, (ConnectionRefusedError, ConnectionAbortedError, TimeoutError)):
        return "a dependency"
    return ""


def error_for(exc: Exception, method: str, path: str, max_body_bytes: int) -> ApiError:
    """The OpenAI-shaped answer for whatever a handler raised: its own ApiError, aiohttp's refusals (404,
    405, a body over the limit), a 503 with Retry-After when a dependency is down, else a 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, web.HTTPMethodNotAllowed):  # RFC 9110: a 405 says which methods the path takes
        error = http_error(exc.status, method, path, max_body_bytes)
        error.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
        return error
    if isinstance(exc, web.HTTPException):
        return http_error(exc.status, method, path, max_body_bytes)
    dependency = unavailable(exc)
    if dependency:
        return ApiError(503, f"{dependency} is unavailable ({type(exc).__name__}: {exc}); retry shortly",
                        kind="service_unavailable", headers={"Retry-After": RETRY_AFTER_S})
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


class HttpServer:
    """One aiohttp server with /health (alive), /ready (able to serve) and /metrics; a service adds its own
    routes to `app` before `start`. Every error it answers is an OpenAI error object, whatever failed, and
    its connections are bounded by `limits` (`kvcentric.runtime.connections`)."""

    def __init__(self, health: HealthView, ready: HealthView, metrics: Metrics,
                 max_body_bytes: int = MAX_BODY_BYTES, limits: HttpLimits | None = None) -> None:
        self.health = health
        self.ready = ready
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.limits = limits or HttpLimits()
        """Set before `start` to change them (the gateway's flags)."""
        self.on_error: Callable[[int], None] = lambda status: None
        """Called with the status of each error answered by the middleware (a service counts them)."""
        self.log = logging.getLogger(f"kvcentric.{metrics.labels['role']}.http")
        self.app = web.Application(client_max_size=max_body_bytes,
                                   middlewares=[self.json_errors, self.body_in_time])
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/ready", self._ready)
        self.app.router.add_get("/metrics", self._metrics)
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self.cap: ConnectionCap | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on host:port (0: any free port), HTTPS with `ssl_context`; returns the port bound."""
        handler_args: dict[str, Any] = {"access_log": None, "keepalive_timeout": self.limits.header_timeout_s,
                                        "lingering_time": LINGER_S}
        self._runner = web.AppRunner(self.app, handler_cancellation=True, **handler_args)
        await self._runner.setup()
        assert self._runner.server is not None
        self.cap = ConnectionCap(self._runner.server, handler_args, self.limits.connection_cap,
                                 self.metrics.counters)
        self._listener = await asyncio.get_running_loop().create_server(self.cap, host, port, backlog=1024,
                                                                        ssl=ssl_context)
        self.port = self._listener.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def json_errors(self, request: web.Request, handler):
        """Whatever a handler raises becomes an OpenAI error object, never aiohttp's plain-text page: a
        dependency down is a 503 with Retry-After, a true bug a 500 (logged with its traceback)."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error = error_for(exc, request.method, request.path, self.max_body_bytes)
        except ConnectionResetError:  # the client left: nobody to answer
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is answered in JSON
            error = error_for(exc, request.method, request.path, self.max_body_bytes)
            if error.status == 500:
                self.log.exception("%s %s failed", request.method, request.path)
            else:
                self.log.warning("%s %s: %s", request.method, request.path, error.message)
        self.metrics.counters[labelled("http_errors_total", status=str(error.status))] += 1
        self.on_error(error.status)
        response = error_response(error)
        if error.status == 408:  # the rest of the body is not waited for
            response.force_close()
        return response

    @web.middleware
    async def body_in_time(self, request: web.Request, handler):
        """Read the request's body within --body-timeout-s (a 408 and a closed connection otherwise), and
        mark its connection busy meanwhile so that the connection cap does not close it."""
        done = self.cap.counting(request.protocol) if self.cap is not None else None
        try:
            if request.can_read_body:
                try:
                    async with asyncio.timeout(self.limits.body_timeout_s):
                        await request.read()
                except TimeoutError:
                    raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} "
                                        f"s", code="request_timeout") from None
            return await handler(request)
        finally:
            if done is not None:
                done()

    async def _health(self, request: web.Request) -> web.Response:
        status, body = await self.health()
        return web.json_response(body, status=status)

    async def _ready(self, request: web.Request) -> web.Response:
        status, body = await self.ready()
        return web.json_response(body, status=status)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render().encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
