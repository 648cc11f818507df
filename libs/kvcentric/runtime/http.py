"""A service's HTTP side: /health, /metrics and the routes a service adds, on one aiohttp server.

What /health says comes from a callback the service gives (status code and body); this module renders
no policy of its own.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvcentric.core.metrics import LATENCY_BUCKETS_S, Histogram, render


class Metrics:
    """A service's counters, histograms and gauges, rendered as Prometheus text with role/instance labels."""

    def __init__(self, role: str, instance_id: str, gauges: Callable[[], dict[str, float]] = dict) -> None:
        self.labels = {"role": role, "instance": instance_id}
        self.counters: collections.Counter[str] = collections.Counter()
        self.histograms: dict[str, Histogram] = {}
        self.gauges = gauges

    def histogram(self, name: str, buckets=LATENCY_BUCKETS_S, help: str = "") -> Histogram:
        """The histogram `name` (exposed as kvc_<name> on /metrics), made on first use with `buckets`."""
        histogram = self.histograms.get(name)
        if histogram is None:
            histogram = self.histograms[name] = Histogram(buckets, help)
        return histogram

    def render(self) -> str:
        return render(self.labels, self.counters, self.gauges(), self.histograms)


MAX_BODY_BYTES = 1 << 20
"""Largest request body a service reads (aiohttp's default, made explicit so errors can name it)."""

HealthView = Callable[[], Awaitable[tuple[int, dict]]]
"""async () -> (HTTP status, JSON body) of GET /health or GET /ready."""


class HttpServer:
    """One aiohttp server with /health (alive), /ready (able to serve) and /metrics; a service adds its own
    routes to `app` before `start`."""

    def __init__(self, health: HealthView, ready: HealthView, metrics: Metrics,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.health = health
        self.ready = ready
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.app = web.Application(client_max_size=max_body_bytes)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/ready", self._ready)
        self.app.router.add_get("/metrics", self._metrics)
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port); returns the port bound."""
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        status, body = await self.health()
        return web.json_response(body, status=status)

    async def _ready(self, request: web.Request) -> web.Response:
        status, body = await self.ready()
        return web.json_response(body, status=status)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render().encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
