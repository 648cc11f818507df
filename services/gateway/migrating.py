"""The gateway's side of request migration: it hears every engine's load reports, ends the wait of a
request whose prefill or decode instance went silent, and places the request's continuation on live
instances. What to decide is `kvcentric.core.migration`'s; the relay goes on reading the new placement's
tokens (`GatewayService.token_chunks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

import nats.errors

from kvc_gateway import relay
from kvcentric.core.metrics import LATENCY_BUCKETS_S, labelled
from kvcentric.core.migration import (Failure, InstanceWatch, MigrationPolicy, chunk_failure, continuation,
                                      culprit_search, silent_failure, waited_on)
from kvcentric.core.openai_api import ApiError
from kvcentric.core.protocol import (BadMessage, Cancel, Heartbeat, Placement, RequestOutcome, SamplingParams,
                                     Subjects, TokenChunk, decode)
from kvcentric.runtime.bus import Bus
from kvcentric.runtime.http import RETRY_AFTER_S, Metrics

WATCH_PERIOD_S = 0.1
"""How often the requests being served are checked against the instances heard from (while none is served, the
check sleeps until one is placed: an idle gateway does not wake ten times a second for nothing)."""

Place = Callable[[relay.Job, list[int], SamplingParams], Awaitable[Placement]]


class Migrations:
    """Watches the instances of the requests in `running` and migrates those they fail."""

    def __init__(self, bus: Bus, metrics: Metrics, running: Mapping[int, relay.Job], policy: MigrationPolicy,
                 silent_after_s: float, log: logging.Logger) -> None:
        self.bus, self.counters, self.running, self.policy, self.log = bus, metrics.counters, running, policy, log
        self.watch = InstanceWatch(silent_after_s)
        self.serving = asyncio.Event()
        """Set when a request is placed; cleared by `check` once none is being served."""
        self.detect = metrics.histogram("migration_detect_seconds", LATENCY_BUCKETS_S,
                                        help="an instance's last load report to its requests' migration")
        self.gap = metrics.histogram("migration_gap_seconds", LATENCY_BUCKETS_S,
                                     help="a migrated request's last token before the failure to its next token")

    async def start(self, spawn: Callable[[Awaitable, str], object],
                    every: Callable[[float, Callable[[], Awaitable[None]]], Awaitable[None]]) -> None:
        await self.bus.subscribe_raw(Subjects.LOAD_ALL, cb=self.on_report)
        spawn(every(WATCH_PERIOD_S, self.check), "migration-watch")

    async def on_report(self, msg) -> None:
        """Any load report says its instance lives (`kvc.load.<role>.<id>`: the subject names it), and its
        heartbeat tick whether it is the process heard before (a restarted one counts again from 1)."""
        try:
            tick = decode(msg.data, Heartbeat).seq
        except BadMessage:
            tick = 0
        self.watch.heard_from(msg.subject.rpartition(".")[2], time.monotonic(), tick, msg.subject)

    def placed(self, job: relay.Job) -> None:
        """The request was placed: its instances are watched from now on."""
        assert job.placement is not None
        job.received_before = len(job.received)
        now = job.placed_at = time.monotonic()
        for instance_id in waited_on(job.placement, 0):
            self.watch.expect(instance_id, now)
        self.serving.set()

    def received(self, job: relay.Job, tokens: int) -> None:
        """Tokens came: a migrated request's stall is over."""
        if tokens and job.stalled_at is not None:
            self.gap.observe(time.perf_counter() - job.stalled_at)
            job.stalled_at = None

    @staticmethod
    def since_placed(job: relay.Job) -> int:
        """Tokens its current placement sent (none yet: it still waits on its prefill instance too)."""
        return len(job.received) - job.received_before

    async def check(self) -> None:
        """End the wait of every request whose instance went silent (its token reader then migrates it); with
        none being served, first wait until one is placed."""
        if not self.running:
            self.serving.clear()
            await self.serving.wait()
        now = time.monotonic()
        for job in list(self.running.values()):
            if job.failure is not None or job.placement is None or job.output is None:
                continue
            failure = silent_failure(job.placement, self.since_placed(job), self.watch, now, job.placed_at)
            if failure is not None:
                job.failure = failure
                self.detect.observe(failure.silence_s)
                with contextlib.suppress(nats.errors.Error):
                    await job.output.unsubscribe()

    async def failure_of(self, job: relay.Job, chunk: TokenChunk) -> Failure | None:
        """The failure an error chunk means when one of the request's instances goes silent within about a
        detection time (the instance to blame); None: an error of live engines (a step that raised, a job
        refused, KV a slow peer never sent) or an overload 429, which goes to the client as it is."""
        failure = chunk_failure(chunk)
        if failure is None:
            return None
        failure = await self.blame(job, failure)
        if not failure.instance_id:
            self.counters["engine_errors_passed_on_total"] += 1
            return None
        return failure

    async def migrate(self, job: relay.Job, place: Place) -> None:
        """Place the continuation of `job`, whose placement failed it (`job.failure`), and listen to its
        tokens; an ApiError 503 with Retry-After when it cannot be migrated or placed."""
        failure = job.failure or Failure("engine_error", "the request failed")
        await self.leave(job, failure)
        refusal = self.policy.refusal(job.request.sampling, job.migrations, len(job.received))
        if refusal:
            raise self.failed(job, failure, f"not migrated: {refusal}")
        job.migrations += 1
        self.counters[labelled("migrations_total", reason=failure.reason)] += 1
        self.log.warning("request %s: %s; migrating it (%d of at most %d) after %d tokens", job.request_id,
                         failure.message, job.migrations, self.policy.max_migrations, len(job.received))
        if failure.instance_id:
            job.avoid.append(failure.instance_id)
        if job.stalled_at is None:
            job.stalled_at = job.last_token_at or job.started
        job.bus_id = f"{job.own_id}-m{job.migrations}"
        job.output = await self.bus.subscribe_raw(Subjects.out(job.bus_id))
        prompt, sampling = continuation(job.token_ids, job.received, job.request.sampling)
        try:
            await place(job, prompt, sampling)
        except ApiError as exc:
            raise self.failed(job, failure, f"its migration was not placed: {exc.message}") from None
        job.failure = None

    async def blame(self, job: relay.Job, failure: Failure) -> Failure:
        """An error chunk does not say which instance failed: the one of the request's instances that goes
        silent within about a detection time, if any (it is not placed on again)."""
        if job.placement is None:
            return failure
        since = time.monotonic()
        deadline = since + 1.5 * self.watch.silent_after_s
        while (now := time.monotonic()) < deadline:
            found = culprit_search(job.placement, self.since_placed(job), self.watch, since, now, job.placed_at)
            if found is None:
                break
            if found != "wait":
                return Failure(failure.reason, f"{failure.message} ({found.message})", found.instance_id,
                               found.silence_s)
            await asyncio.sleep(WATCH_PERIOD_S)
        return failure

    async def leave(self, job: relay.Job, failure: Failure) -> None:
        """Drop the failed placement: stop listening, cancel it where it may still run, and tell the
        conductor it ended (its accounting forgets it)."""
        with contextlib.suppress(nats.errors.Error):
            await job.output.unsubscribe()
        placement, bus_id = job.placement, job.bus_id
        await self.bus.publish(Subjects.cancel(bus_id), Cancel(request_id=bus_id, reason=f"gateway: {failure.message}"))
        if placement is not None:
            await self.bus.publish(Subjects.OUTCOME, RequestOutcome(
                request_id=bus_id, prefill_id=placement.prefill_id, decode_id=placement.decode_id,
                finish_reason="migrated", ttft_s=-1.0, e2e_s=time.perf_counter() - job.started,
                prompt_tokens=len(job.token_ids), completion_tokens=len(job.received)))

    def failed(self, job: relay.Job, failure: Failure, why: str) -> ApiError:
        self.counters[labelled("migrations_failed_total", reason=failure.reason)] += 1
        self.log.warning("request %s: %s; %s", job.request_id, failure.message, why)
        return ApiError(503, f"{failure.message}; {why}", kind="service_unavailable",
                        headers={"Retry-After": RETRY_AFTER_S})
