"""A service is a few parts put together: a `Bus` (NATS), an `HttpServer` (/health, /metrics, its own
routes), `Metrics` and `Tasks` (its background work and the stop event). This module owns only their
lifecycle: open them in order, run until a signal, close them in reverse. It holds no policy.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import json
import logging
import os
import secrets
import signal
import ssl

from aiohttp import web

from kvcentric.config import BusConfig
from kvcentric.runtime import tracing
from kvcentric.runtime.bus import Bus
from kvcentric.runtime.http import HttpServer, Metrics
from kvcentric.runtime.security import NatsAccess, nats_access
from kvcentric.runtime.tasks import Tasks


class Service:
    """The parts of one service and their lifecycle; a role fills in `start`, `stop` and `health`."""

    role = "service"

    def __init__(self, config: BusConfig) -> None:
        self.config = config
        self.instance_id = config.instance_id or f"{self.role}-{secrets.token_hex(3)}"
        self.log = logging.getLogger(f"kvcentric.{self.role}")
        self.metrics = Metrics(self.role, self.instance_id, self.gauges)
        self.counters = self.metrics.counters
        self.tasks = Tasks(self.log)
        self.stopping = self.tasks.stopping
        self.bus = Bus(self.instance_id, self.counters, self.log)
        self.http = HttpServer(self.health_view, self.ready_view, self.metrics)
        self.nats_access = NatsAccess(config.nats_url)
        """How this service reaches NATS (credentials, TLS): read from the files its flags name when it opens."""
        self.ready = False
        self.owns_process = False
        """Set by `run_service`: this service has its process to itself, so it may change the whole process's
        settings once started (`freeze_heap`); not when a test runs it beside others."""

    # ---------------------------------------------------------------- what a role fills in

    async def start(self) -> None:
        """Subscribe and start loops. Called once NATS is connected and HTTP listens (answering 503)."""

    async def stop(self) -> None:
        """Release what start() took. Called after the stop event, before NATS is drained."""

    def add_routes(self, app: web.Application) -> None:
        """HTTP routes of the role besides /health and /metrics."""

    def http_tls(self) -> ssl.SSLContext | None:
        """The TLS of the HTTP side (None: plain HTTP); the gateway's --https-cert."""
        return None

    def health(self) -> dict:
        """Role-specific fields of GET /health."""
        return {}

    async def health_view(self) -> tuple[int, dict]:
        """GET /health: 200 once started, 503 before; a role may override to add its own condition."""
        body = {"status": "ok" if self.ready else "starting", "role": self.role,
                "instance_id": self.instance_id, "cluster": self.config.cluster, **self.health()}
        return (200 if self.ready else 503), body

    async def readiness(self) -> str:
        """Why this service cannot serve yet ("" once it can). Roles add their own condition: an engine
        until the conductor has its first load report, the conductor until it sees a prefill and a decode
        instance, the gateway until its conductor is ready, kvs-meta while Redis does not answer."""
        return "" if self.ready else "starting"

    async def ready_view(self) -> tuple[int, dict]:
        """GET /ready: 200 when `readiness` has no objection, else 503 with the reason; apart from /health,
        which says only that the process is alive (a probe should restart on /health, route on /ready)."""
        reason = await self.readiness() if self.ready else "starting"
        body = {"ready": not reason, "role": self.role, "instance_id": self.instance_id,
                **({"reason": reason} if reason else {})}
        return (503 if reason else 200), body

    def gauges(self) -> dict[str, float]:
        return {}

    @property
    def hands_over(self) -> bool:
        """Another service goes on in this process once this one stops (see `run_service`)."""
        return False

    @classmethod
    def prepare_process(cls, config):
        """Called once in a process this service has to itself (its command), before the service is built:
        settings of the whole process; returns the config to build it with."""
        return config

    def successor(self) -> Service | None:
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
        self.nats_access = nats_access(self.config)
        await self.bus.connect(self.nats_access, self.stopping)
        self.add_routes(self.http.app)
        tls = self.http_tls()
        await self.http.start(self.config.host, self.config.port, tls)
        if self.config.port_file:
            write_port_file(self.config.port_file, self.http.port)
        await self.start()
        if self.owns_process:
            freeze_heap()
        self.ready = True
        self.log.info("%s %s ready: %s://%s:%d", self.role, self.instance_id, "https" if tls else "http",
                      self.config.host, self.http.port)

    async def close(self) -> None:
        self.ready = False
        self.stopping.set()
        await self.stop()
        await self.tasks.cancel_all()
        await self.bus.close()
        await self.http.close()
        if not self.hands_over:  # the tracer is the process's; the next service goes on with it
            await asyncio.get_running_loop().run_in_executor(None, tracing.shutdown)

    @property
    def http_port(self) -> int:
        return self.http.port


def turned_off(variable: str) -> bool:
    """Whether a process-wide setting that is on by default was turned off in the environment (0/false/no/off)."""
    return os.environ.get(variable, "1").lower() in ("0", "false", "no", "off")


def freeze_heap() -> None:
    """Once a service has started: collect, then take every object alive (modules, the model's weights and their
    wrappers, the tokenizer, compiled kernels) out of the collector's sight for good (`gc.freeze`).

    A full collection walks every tracked object with the GIL held, so it stops each of the process's threads.
    An engine tracks hundreds of thousands of objects once its model is loaded, so one landing in a burst stops
    the model between two steps for as long as the walk takes; after the freeze a walk sees only what was made
    since (docs/performance.md, "Garbage collection and page faults"). KVC_GC_FREEZE=0 leaves the collector as
    it is."""
    if turned_off("KVC_GC_FREEZE"):
        return
    gc.collect()
    gc.freeze()


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
"""glibc's `mallopt` parameters (malloc.h)."""
KEPT_ALLOCATION_BYTES = 32 << 20
"""Allocations up to this size come from the heap and go back to it (glibc's ceiling for M_MMAP_THRESHOLD on
64-bit): a prefill step's activations of `small` at 2048 rows are at most 23 MB each (the MLP's gate|up)."""
KEPT_FREE_BYTES = 1 << 30
"""Free memory at the top of a heap that glibc keeps instead of giving back to the kernel (a C int)."""


def keep_heap() -> bool:
    """Have glibc's malloc keep freed memory for reuse, so a model step's activations land in pages already
    mapped: returns whether it could (False off glibc, or with KVC_MALLOC_KEEP=0).

    As is, glibc maps an allocation over its threshold (128 KiB at first, raised to the largest freed since, up
    to 32 MiB) and unmaps it when freed, gives back a heap's free top past its trim threshold, and gives a new
    thread an arena of its own whose heaps come and go. A model step allocates tens of megabytes of activations
    and frees them before the next, so the model thread's steps kept touching fresh pages (each fault a kernel
    entry and a zeroed 4 KiB page). Here: the mmap threshold at its ceiling, the trim threshold at 1 GiB, and one
    arena for every thread (a thread started later shares the main one), so the steps reuse mapped pages
    (docs/performance.md, "Garbage collection and page faults"). The heap holds a step's peak of activations for
    good, which the process needed anyway.

    Not for a GPU engine (`heap_kept_for`): its activations live on the device, and its many threads would share
    the one arena's lock; on an H100 the served colocated instance ran slower with it in most runs
    (docs/performance.md, "Disaggregated vs single process")."""
    if turned_off("KVC_MALLOC_KEEP"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, KEPT_ALLOCATION_BYTES), (M_TRIM_THRESHOLD, KEPT_FREE_BYTES), (M_ARENA_MAX, 1))
    return all(mallopt(parameter, value) for parameter, value in settings)


def heap_kept_for(config: object) -> bool:
    """Whether a service of this config keeps its heap (`keep_heap`): all but an engine on a CUDA device."""
    return not str(getattr(config, "device", "cpu")).startswith("cuda")


def write_port_file(path: str, port: int) -> None:
    """Say which port this process bound (--port-file), whole or not at all (written aside, then renamed)."""
    with open(path + ".tmp", "w") as out:
        json.dump({"port": port, "pid": os.getpid()}, out)
    os.replace(path + ".tmp", path)


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
    if heap_kept_for(service.config):
        keep_heap()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        current: Service | None = service
        while current is not None:
            current.owns_process = True
            runner.run(current.run())
            current = current.successor()
