"""The gateway's side of placement: it asks a live conductor replica where a job runs (asking again while none
answers, and under a new request id after one went silent holding it), and with --dispatch gateway hands the jobs
to the placed engines itself. It decides nothing: the decision is the conductor's, what a rejection becomes is
`kvcentric.core.errors`'.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import time
import uuid

import msgspec
import nats.errors

from kvc_gateway import relay
from kvc_gateway.config import GatewayConfig
from kvc_gateway.migrating import Migrations
from kvcentric.core.dispatch import jobs
from kvcentric.core.errors import rejection_error
from kvcentric.core.hashing import to_hex
from kvcentric.core.metrics import labelled
from kvcentric.core.openai_api import ApiError
from kvcentric.core.protocol import (BadMessage, Cancel, ConductorAlive, Dispatch, Placement, Rejection,
                                     SamplingParams, ScheduleReply, ScheduleRequest, Subjects, encode)
from kvcentric.core.scheduling.leadership import Leadership
from kvcentric.runtime import dispatch
from kvcentric.runtime.bus import Bus
from kvcentric.runtime.http import BUS_DOWN, RETRY_AFTER_S

NO_RESPONDERS_PAUSE_S = 0.1
"""Pause before asking again when no conductor is subscribed (one restarting, NATS reconnecting)."""
CONDUCTOR_LEASE_S = 1.5
"""A conductor replica not heard from for this long (three of its 0.5 s heartbeats) is not asked again."""


class SilentConductor(ApiError):
    """The conductor that took a schedule request did not answer in time (it may have died holding it)."""


class Placing:
    """Places jobs through the conductor replicas heard from lately."""

    def __init__(self, config: GatewayConfig, bus: Bus, counters: collections.Counter[str],
                 migrations: Migrations) -> None:
        self.config, self.bus, self.counters, self.migrations = config, bus, counters, migrations
        self.hasher = config.hasher()
        self.slos: dict[str, float] = {}
        """The SLOs the latest placement was admitted under (the conductor's, absolute or relative), for /health."""
        self.conductors = Leadership(f"gateway-{uuid.uuid4().hex[:8]}", time.monotonic(), CONDUCTOR_LEASE_S)
        """The conductor replicas heard from lately: a retry after a silent one goes straight to one of them."""

    async def start(self) -> None:
        await self.bus.subscribe(Subjects.CONDUCTORS, ConductorAlive, self.on_conductor)

    async def on_conductor(self, alive: ConductorAlive) -> None:
        self.conductors.heard(alive.instance_id, time.monotonic())

    def schedule_subject(self) -> str:
        """Where to ask: a conductor replica that heartbeats still, chosen at random (the queue group would
        also hand requests to a stopped one, which NATS keeps subscribed until its pings fail); the queue
        group itself while none has been heard (a gateway just started)."""
        live = self.conductors.peers(time.monotonic())
        return Subjects.schedule_at(random.choice(live)) if live else Subjects.SCHEDULE

    async def ask(self, message, kind):
        """One request/reply to a conductor; while nobody answers it asks again (another replica, or the
        same once it is back) for up to --bus-timeout-s: nothing was delivered, so asking again is safe."""
        patience = time.monotonic() + self.config.bus_timeout_s
        while True:
            subject = self.schedule_subject()
            try:
                return await self.bus.request(subject, message, kind, timeout_s=self.config.bus_timeout_s)
            except nats.errors.NoRespondersError:
                self.counters["schedule_no_responders_total"] += 1
                if subject != Subjects.SCHEDULE:  # that replica is gone although its last heartbeat is recent
                    self.conductors.forget(subject.rpartition(".")[2])
                if time.monotonic() < patience:
                    await asyncio.sleep(NO_RESPONDERS_PAUSE_S)
                    continue
                raise ApiError(503, f"nobody answers on {subject}", kind="service_unavailable",
                               headers={"Retry-After": RETRY_AFTER_S}) from None
            except (TimeoutError, nats.errors.TimeoutError):
                raise SilentConductor(503, f"no answer on {subject} in {self.config.bus_timeout_s} s "
                                           f"(--bus-timeout-s)", kind="service_unavailable",
                                      headers={"Retry-After": RETRY_AFTER_S}) from None
            except BadMessage as exc:
                raise ApiError(500, f"a bad answer on {subject}: {exc}", kind="server_error") from None
            except nats.errors.MaxPayloadError:
                raise self.too_large() from None
            except BUS_DOWN as exc:
                raise ApiError(503, f"the bus is unavailable ({type(exc).__name__}); retry shortly",
                               kind="service_unavailable", headers={"Retry-After": RETRY_AFTER_S}) from None

    def too_large(self) -> ApiError:
        return ApiError(400, f"the prompt is too large for the bus (NATS max_payload {self.bus.max_payload} bytes): "
                             f"shorten it or raise the server's max_payload", code="request_too_large")

    async def place(self, job: relay.Job, token_ids: list[int], sampling: SamplingParams) -> Placement:
        """Ask the conductor to place `token_ids` (the prompt, or a migrated request's continuation). With
        --dispatch conductor it hands the jobs to the engines as it answers; with --dispatch gateway they
        are sent from here, to prefill and decode at once."""
        ask = self.schedule_request(job, token_ids, sampling)
        job.dispatch_pending = ask.dispatch is not None
        try:
            decision = await self.ask(ask, ScheduleReply)
        except SilentConductor:
            decision = await self.ask(await self.renew(job, ask), ScheduleReply)
        job.dispatch_pending = False
        if isinstance(decision, Rejection):
            self.counters[labelled("rejections_total", reason=decision.reason)] += 1
            raise rejection_error(decision)
        job.placement = decision
        job.progress_at = time.perf_counter() + max(0.0, decision.predicted_ttft_s)
        if decision.ttft_slo_s > 0 or decision.tbt_slo_s > 0:
            self.slos = {"ttft_s": decision.ttft_slo_s, "tbt_s": decision.tbt_slo_s}
        if job.cached_tokens is None:
            job.cached_tokens = decision.cached_tokens
        self.migrations.placed(job)
        if not decision.dispatched:  # asked not to, or a conductor from before dispatching
            await self.send_jobs(job, decision, token_ids, sampling)
        return decision

    async def renew(self, job: relay.Job, ask: ScheduleRequest) -> ScheduleRequest:
        """After a conductor went silent holding `ask` (another replica of the queue group answers next): cancel
        it on any engine it was handed to, and ask again under a new request id, whose output is listened to
        from now on, so a late job of the old id can neither run nor mix into this stream."""
        await self.bus.publish(Subjects.cancel(job.bus_id),
                               Cancel(request_id=job.bus_id, reason="gateway: its conductor went silent"))
        with contextlib.suppress(nats.errors.Error):  # already ended by `end_streams` when the bus dropped
            await job.output.unsubscribe()
        self.counters["schedule_retries_total"] += 1
        job.bus_id = f"{job.bus_id.partition('-')[0]}-{uuid.uuid4().hex}"
        if job.placement is None and job.batch_index is None:  # its first placement: the client hears the new id
            job.request_id = job.bus_id
        job.output = await self.bus.subscribe_raw(Subjects.out(job.bus_id))
        return msgspec.structs.replace(ask, request_id=job.bus_id)

    def schedule_request(self, job: relay.Job, token_ids: list[int], sampling: SamplingParams) -> ScheduleRequest:
        """What the conductor is asked; with --dispatch conductor it carries the jobs' tokens too, unless
        that would not fit in one NATS message (then they go straight to prefill from here)."""
        unfull = self.config.kvs_enable_save_unfull_chunk
        hashes = [to_hex(h) for h in self.hasher.prefix_keys(token_ids, unfull)]
        ask = ScheduleRequest(request_id=job.bus_id, n_tokens=len(token_ids), block_hashes=hashes,
                              max_tokens=sampling.max_tokens, priority=-job.request.priority, avoid=job.avoid)
        if self.config.dispatch != "conductor":
            return ask
        with_jobs = msgspec.structs.replace(ask, dispatch=Dispatch(token_ids=token_ids, sampling=sampling))
        if len(encode(with_jobs)) <= self.bus.max_payload:
            return with_jobs
        self.counters["dispatch_too_large_total"] += 1
        return ask

    async def send_jobs(self, job: relay.Job, placement: Placement, token_ids: list[int],
                        sampling: SamplingParams) -> None:
        """Hand the jobs to the placed engines; 503 when one did not take its job."""
        try:
            why = await dispatch.submit(self.bus, jobs(job.bus_id, placement, token_ids, sampling),
                                        self.config.bus_timeout_s)
        except nats.errors.MaxPayloadError:
            raise self.too_large() from None
        if why:
            raise ApiError(503, why, kind="service_unavailable", headers={"Retry-After": RETRY_AFTER_S})
