"""The conductor's asyncio shell: feeds load reports and request outcomes into the Conductor core, finds
where each request's prefix blocks are, and answers kvc.conductor.schedule with the core's decision. All
policy is in `kvcentric.core.scheduling`.

Prefix hits come from a local mirror of kvs-meta's block index (`--prefix-index local`, the default): it
follows the same kvc.kv.events.> events kvs-meta ingests, and at start it is seeded from kvs-meta's
kvc.kvs.dump (events are buffered meanwhile and applied after the dump, so none is lost or applied out of
order). Until the seed is done, and always with `--prefix-index kvs-meta`, it asks kvs-meta once per
request (one batch, with retries and health gating). When kvs-meta is down or unreachable on that path,
placement is load-only (no prefix hits), counted in `placements_load_only_total` and shown by the
`kvs_metadata_down` gauge. kvs-meta stays the durable source of truth; the mirror is never written back.
Finding the hits is `kvc_conductor.prefixes`; what /health and /metrics show is `kvc_conductor.reporting`.

Several conductors may run side by side: they answer kvc.conductor.schedule from one NATS queue group (each
request reaches one of them), while load reports, outcomes and KV events reach each, so each keeps its own
view (their estimates may differ; each placement is made from a whole view). They heartbeat on
kvc.conductor.alive, and only the leader (`Leadership`: the lowest live id) sends re-planning role switches.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from kvc_conductor.config import ConductorConfig
from kvc_conductor.prefixes import PrefixHits
from kvc_conductor.replanning import ReplanLoop
from kvc_conductor.reporting import Reporting
from kvcentric.core.costmodel import CostModel
from kvcentric.core.dispatch import Submit, bad_dispatch, jobs
from kvcentric.core.protocol import (Cancel, ConductorAlive, Dispatch, InstancesQuery, InstancesReply, KVEventBatch,
                                     LoadReport, Placement, Rejection, RequestOutcome, ScheduleRequest, Subjects,
                                     TokenChunk)
from kvcentric.core.scheduling.conductor import Conductor
from kvcentric.core.scheduling.leadership import Leadership
from kvcentric.runtime import dispatch
from kvcentric.runtime.service import Service

HEARTBEAT_S = 0.5
"""How often a conductor says it is alive to the other replicas (one is taken for gone after 3 missed)."""
WARM_UP_S = 1.0
"""How long a conductor that has just started waits for the engines' first load reports (they come about ten
times a second) before it places without them."""
SCHEDULERS = "conductor"
"""The NATS queue group every conductor answers kvc.conductor.schedule in."""


class ConductorService(Service):
    role = "conductor"

    def __init__(self, config: ConductorConfig) -> None:
        super().__init__(config)
        self.config: ConductorConfig = config
        prfaas_cost = CostModel.load(config.prfaas_profile) if config.prfaas_profile else None
        self.core = Conductor(config.scheduler, config.cost_model(), stale_after_s=config.stale_after_s,
                              stuck_after_s=config.stuck_after_s, clusters=config.clusters(prfaas_cost),
                              prior_trusted=config.prior_trusted, use_measured=config.cost_source == "measured")
        self.registry = self.core.registry
        self.prefixes = PrefixHits(config, self.bus, self.counters, self.log)
        self.gate, self.seeding, self.index = self.prefixes.gate, self.prefixes.seeding, self.prefixes.index
        self.leadership = Leadership(self.instance_id, time.monotonic(), lease_s=3 * HEARTBEAT_S)
        self.started_at = time.monotonic()
        self.warm = False
        """It has heard from a prefill and a decode instance, or has run WARM_UP_S (`warmed_up`)."""
        self.replan = (ReplanLoop.from_config(self.core, self.bus, self.counters, self.log, config)
                       if config.replan_interval_s > 0 else None)
        self.reporting = Reporting(config, self.core, self.prefixes, self.leadership, self.replan)

    @property
    def pending(self) -> list[tuple[float, KVEventBatch]] | None:
        """KV events that arrived while the local index is being seeded; None once it is live."""
        return self.seeding.pending

    @property
    def seeded(self) -> bool:
        return self.seeding.seeded

    async def start(self) -> None:
        await self.prefixes.start(self.tasks)
        await self.bus.subscribe(Subjects.LOAD_ALL, LoadReport, self.on_load)
        await self.bus.subscribe(Subjects.OUTCOME, RequestOutcome, self.on_outcome)
        await self.bus.subscribe(Subjects.FIRST_TOKEN, RequestOutcome, self.on_first_token)
        await self.bus.subscribe(Subjects.SCHEDULE, ScheduleRequest, self.on_schedule, queue=SCHEDULERS,
                                 bad_reply=lambda error: Rejection.bad_request("", error))
        await self.bus.subscribe(Subjects.schedule_at(self.instance_id), ScheduleRequest, self.on_schedule,
                                 bad_reply=lambda error: Rejection.bad_request("", error))
        await self.bus.subscribe(Subjects.INSTANCES, InstancesQuery, self.on_instances,
                                 bad_reply=lambda error: self.instances())
        self.tasks.spawn(self.tasks.every(10.0, self.forget_departed), "forget-departed")
        await self.bus.subscribe(Subjects.CONDUCTORS, ConductorAlive, self.on_conductor)
        self.tasks.spawn(self.tasks.every(HEARTBEAT_S, self.say_alive), "heartbeat")
        if self.replan is not None:
            self.tasks.spawn(self.tasks.every(self.config.replan_interval_s, self.replan_tick), "replan")
        self.log_setup()

    def log_setup(self) -> None:
        slos = self.config.slos
        ttft = f"{slos.ttft_slo_s:g} s" if slos.ttft_slo_s else f"{slos.ttft_factor:g}x unloaded"
        tbt = f"{slos.tbt_slo_s:g} s" if slos.tbt_slo_s else f"{slos.tbt_factor:g}x unloaded"
        burst = f", bursts queued up to {self.config.bursts_s:g} s" if self.config.bursts_s else ""
        self.log.info("policy %s, rejection %s (TTFT SLO %s, TBT SLO %s%s), queue time %s%s, cost model %s (%s), "
                      "prefix index %s", self.config.policy, self.config.rejection, ttft, tbt, burst,
                      self.config.queue_time,
                      (", blocks expected at placement" if self.config.expect_cache else "")
                      + (", TTFT corrected from outcomes" if self.config.ttft_correction else ""),
                      self.core.estimator.cost.source,
                      "trusted" if self.config.prior_trusted else "ranks only until measured", self.config.prefix_index)
        if self.core.router is not None:
            router = self.core.router
            self.log.info("PrfaaS routing: local PD cluster %s, prfaas clusters %s, t = %d uncached tokens",
                          router.pd, ", ".join(router.prfaas) or "none", router.threshold)

    async def on_load(self, report: LoadReport) -> None:
        now = time.monotonic()
        models = self.core.models
        if report.cost is not None and models.use_measured and report.instance_id not in models.models:
            self.log.info("%s measured its cost model: %s", report.instance_id, report.cost)
        self.core.observe(report, now)
        self.prefixes.heard(report.instance_id, now)

    # ---------------------------------------------------------------- replicas

    async def on_conductor(self, alive: ConductorAlive) -> None:
        self.leadership.heard(alive.instance_id, time.monotonic())

    async def say_alive(self) -> None:
        await self.bus.publish(Subjects.CONDUCTORS, ConductorAlive(instance_id=self.instance_id))

    async def replan_tick(self) -> None:
        """Every replica follows the pools; only the leader switches roles (one switch, not one per replica)."""
        assert self.replan is not None
        await self.replan.tick(leads=self.leadership.leads(time.monotonic()))

    async def on_outcome(self, outcome: RequestOutcome) -> None:
        self.core.on_outcome(outcome, time.monotonic())

    async def on_first_token(self, outcome: RequestOutcome) -> None:
        self.counters["first_tokens_heard_total"] += 1
        self.core.on_first_token(outcome, time.monotonic())

    async def on_schedule(self, request: ScheduleRequest):
        problem = bad_dispatch(request)
        if problem:
            self.counters["bus_drops_total"] += 1
            return Rejection.bad_request(request.request_id, problem)
        if not self.warm:
            await self.warmed_up()
        hits = await self.prefixes.of(request.block_hashes) if self.core.cache_aware(request) else {}
        decision = self.core.schedule(request, hits if hits is not None else {}, time.monotonic())
        self.counters[f"schedule_{type(decision).__name__.lower()}_total"] += 1
        if hits is None and not isinstance(decision, Rejection):
            self.counters["placements_load_only_total"] += 1
        if isinstance(decision, Placement):
            self.counters["kv_cache_hit_len_tokens_total"] += decision.cached_tokens  # Llumnix's kvCacheHitLen
            self.counters["placed_prompt_tokens_total"] += request.n_tokens
            if self.replan is not None:
                self.replan.placed(request, decision)
            if request.dispatch is not None:
                decision = await self.hand_to_engines(request, request.dispatch, decision)
        return decision

    async def warmed_up(self) -> None:
        """A conductor that has just started (a replica joining, one restarted) has no view yet: a request the
        queue group gives it waits for the engines' first load reports (at most WARM_UP_S from its start)
        instead of being refused for want of them."""
        while not self.warm:
            if time.monotonic() - self.started_at >= WARM_UP_S or not await self.readiness():
                self.warm = True
            else:
                await asyncio.sleep(0.02)

    async def hand_to_engines(self, request: ScheduleRequest, what: Dispatch, placement: Placement) -> Placement:
        """Send the jobs (`what` is `request.dispatch`) ahead of the answer, which does not wait for their
        acks (`check_taken` does)."""
        placement = msgspec.structs.replace(placement, dispatched=True)
        rid = request.request_id
        submits = jobs(rid, placement, what.token_ids, what.sampling)
        try:
            sent = await dispatch.send(self.bus, submits)
        except Exception:  # one job may be out: take it back (the caller answers bad_request)
            self.core.forget(rid)
            await self.bus.publish(Subjects.cancel(rid), Cancel(request_id=rid, reason="conductor: dispatch failed"))
            raise
        self.tasks.spawn(self.check_taken(request, submits, sent), f"dispatch-{rid}")
        return placement

    async def check_taken(self, request: ScheduleRequest, submits: list[Submit], sent: list[asyncio.Future]) -> None:
        """Wait for the engines' acks. When one did not take the job, the gateway hears it as an error chunk
        on the request's output (HTTP 503) and an engine that did take it gets a Cancel."""
        why = await dispatch.taken(self.bus, submits, sent, self.config.submit_timeout_s)
        self.counters["dispatched_total"] += 1
        if not why:
            return
        self.counters["dispatch_failures_total"] += 1
        self.log.warning("request %s: %s", request.request_id, why)
        rid = request.request_id
        self.core.forget(rid)  # it will not run: out of the dispatch-time accounting (the gateway may be gone)
        await self.bus.publish(Subjects.out(rid), TokenChunk.failed(rid, why, prompt_tokens=request.n_tokens,
                                                                    status=503))
        await self.bus.publish(Subjects.cancel(rid), Cancel(request_id=rid, reason=f"conductor: {why}"))

    # ---------------------------------------------------------------- instances, health, metrics

    async def forget_departed(self) -> None:
        self.registry.forget_stale(time.monotonic())

    async def on_instances(self, query: InstancesQuery) -> InstancesReply:
        return self.instances(query.role)

    def instances(self, role: str = "") -> InstancesReply:
        snapshot = self.registry.snapshot(time.monotonic())
        return InstancesReply(instances=[i for i in snapshot if not role or i.role == role])

    async def readiness(self) -> str:
        """Ready to place requests once a prefill and a decode instance report (a colocated one is both)."""
        now = time.monotonic()
        missing = [role for role, alive in (("prefill", self.registry.alive_prefill(now)),
                                            ("decode", self.registry.alive_decode(now))) if not alive]
        return f"no {' and no '.join(missing)} instance alive" if missing else ""

    def health(self) -> dict:
        return self.reporting.health(time.monotonic())

    def gauges(self) -> dict[str, float]:
        return self.reporting.gauges(time.monotonic())
