"""The messenger's sink on a node that decodes: pushed KV goes straight into the decode engine's paged
cache, and the commit that closes a push lets the request join the batch.

Pushed KV may overtake its request's DecodeJob (the jobs go to prefill and decode at once): the sink holds
it until the job is in, and gives up after JOB_WAIT_S, or at once when the request is cancelled. KV the
engine has no room for, on the device or in host staging, waits for room (the push held, back-pressured through
gRPC's flow control) while steps free blocks, up to ROOM_WAIT_S: its prompt is computed, and a request that ends
frees room within a few steps; only past that does its request end with a 429. A request whose job names a
local prefix source (PrfaaS §3.3) gets the prefix's KV from that pull (`engine/service/prefixkv.py`) when its push
begins, and only the rest from the push. A push that breaks off leaves the blocks whose every layer arrived
findable for the request's continuation (`engine/service/keptkv.py`). It receives; it does not schedule decode
steps.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Container, Sequence

from kvcentric.core.protocol import TokenChunk
from kvcentric.engine.cores.decode import DecodeEngine, KVNoRoom, KVRejected
from kvcentric.engine.service.keptkv import KeptKV
from kvcentric.engine.service.node import Wakeup
from kvcentric.engine.service.prefixkv import PrefixPulls, prefix_layers
from kvcentric.engine.service.spans import RequestSpans

JOB_WAIT_S = 5.0
"""How long pushed KV waits for its request's DecodeJob: the conductor (or the gateway) sends the decode
and the prefill jobs at once, so the first layer can overtake the job on a fast prefill."""

ROOM_WAIT_S = 30.0
"""How long a computed prompt's KV waits for room (blocks, or host staging) before its request is refused: the
conductor admits by the room the decode instance last reported, which the requests running there grow into as they
generate, so a burst may find it full for a few steps; refusing then would throw the prefill away."""


class DecodeSink:
    """KV into `engine`; `recent_cancels` holds the requests cancelled lately, `emit` takes the token chunks a
    commit or an abort produces, `wake` wakes the work loop."""

    copies_bytes = True
    """`write` copies a layer into the paged cache before it returns (views of a sender's memory will do)."""

    def __init__(self, engine: DecodeEngine, counters: collections.Counter[str], recent_cancels: Container[str],
                 spans: RequestSpans, emit: Callable[[Sequence[TokenChunk | None]], None], wake: Wakeup) -> None:
        self.engine, self.counters, self.recent_cancels = engine, counters, recent_cancels
        self.spans, self.emit, self.wake = spans, emit, wake
        self.waiting: dict[str, asyncio.Event] = {}
        self.room = asyncio.Event()
        """Set (and replaced) whenever blocks or staging may have been freed: KV waiting for room tries again."""
        self.prefixes: PrefixPulls | None = None
        """Set by the service: the local prefix pulls of PrfaaS requests."""
        self.kept: KeptKV | None = None
        """Set by the service: where the KV of a push that breaks off is kept (`engine/service/keptkv.py`)."""

    def registered(self, request_id: str) -> None:
        """The request's DecodeJob is in: KV that came first may go on."""
        event = self.waiting.get(request_id)
        if event is not None:
            event.set()

    def cancelled(self, request_id: str) -> None:
        """The request was cancelled: KV waiting for its job gives up now, not after JOB_WAIT_S (the prefill
        pushing it would wait as long)."""
        self.registered(request_id)
        if self.prefixes is not None:
            self.prefixes.forget(request_id)

    async def begin(self, header) -> None:
        dtype = self.engine.runner.dtype_name
        if header.dtype != dtype:
            raise KVRejected(f"KV dtype {header.dtype}, this instance runs {dtype}")
        if header.request_id not in self.engine.requests:
            await self._job_of(header.request_id)
        first_stripe = header.request_id in self.engine.requests and \
            self.engine.requests[header.request_id].state == "waiting_kv"
        await self._begin_when_room(header)
        if first_stripe and self.prefixes is not None and self.prefixes.expects(header.request_id):
            await self._write_prefix(header.request_id)

    async def _begin_when_room(self, header) -> None:
        """`begin_kv`, waiting for room while steps free blocks, up to ROOM_WAIT_S; then (overload, not failure) the
        request ends with a 429 the client may retry."""
        deadline, waited = time.monotonic() + ROOM_WAIT_S, False
        while True:
            try:
                self.engine.begin_kv(header.request_id, header.num_tokens, header.num_layers, header.token_ids,
                                     join=header.stripes > 1, pool_addr=header.pool_addr)
                return
            except KVNoRoom as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.counters["kv_room_refused_total"] += 1
                    self.emit([self.engine.abort(header.request_id, "error", str(exc), status=429)])
                    raise
            if not waited:
                waited = True
                self.counters["kv_room_waits_total"] += 1
            room = self.room
            try:
                async with asyncio.timeout(min(left, 1.0)):  # a bound on each wait: staging frees without a step
                    await room.wait()
            except TimeoutError:
                pass

    def freed(self) -> None:
        """Blocks or staging may have been freed (a step ended requests, a request was cancelled): KV waiting for
        room tries again."""
        self.room.set()
        self.room = asyncio.Event()

    async def _write_prefix(self, request_id: str) -> None:
        """PrfaaS §3.3: the prompt's prefix KV from the local instance that caches it (pulled since the
        job came), written as the push's first layers."""
        try:
            blocks, tokens = await self.prefixes.blocks(request_id)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - without its prefix the request cannot decode
            self.counters["prefix_pulls_failed_total"] += 1
            raise KVRejected(f"request {request_id}: pulling its prefix KV failed: {exc}") from exc
        runner = self.engine.runner
        for layer, key, value in prefix_layers(blocks, tokens, runner.config.num_layers, runner.block_size,
                                               runner.layer_token_bytes):
            self.engine.write_kv(request_id, layer, 0, tokens, key, value)
        self.counters["prefix_tokens_pulled_total"] += tokens

    async def _job_of(self, request_id: str) -> None:
        event = self.waiting.setdefault(request_id, asyncio.Event())
        self.counters["kv_before_job_total"] += 1
        try:
            if request_id not in self.recent_cancels:
                async with asyncio.timeout(JOB_WAIT_S):
                    await event.wait()
        except TimeoutError:
            raise KVRejected(f"request {request_id} is not expected here (no job in {JOB_WAIT_S:g} s)") from None
        finally:
            self.waiting.pop(request_id, None)
        if request_id in self.recent_cancels and request_id not in self.engine.requests:
            raise KVRejected(f"request {request_id} was cancelled")

    def write(self, request_id: str, chunk) -> None:
        self.engine.write_kv(request_id, chunk.layer, chunk.token_start, chunk.token_end, chunk.key, chunk.value)

    def commit(self, request_id: str, commit) -> None:
        if self.prefixes is not None:
            self.prefixes.forget(request_id)
        self.spans.end(request_id, "decode.queue")
        self.spans.start(request_id, "decode.generate").add_event("first_token", {"kvc.token": commit.first_token})
        self.emit(self.engine.commit_kv(request_id, commit.first_token, commit.extras))
        self.wake.set()

    def abort(self, request_id: str, reason: str, retryable: bool = False) -> None:
        if self.kept is not None:  # what arrived in every layer stays findable for the request's continuation
            self.kept.keep(request_id, time.monotonic())
        if retryable:
            self.engine.reset_kv(request_id)
        else:
            if self.prefixes is not None:
                self.prefixes.forget(request_id)
            # the sender stopped or failed: our side, so 503 (retry later), not 500
            self.emit([self.engine.abort(request_id, "error", f"KV transfer failed: {reason}", status=503)])
