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
The seeding's states are `kvcentric.core.scheduling.seeding`; this module only feeds it and asks for pages.

Several conductors may run side by side: they answer kvc.conductor.schedule from one NATS queue group (each
request reaches one of them), while load reports, outcomes and KV events reach each, so each keeps its own
view (their estimates may differ; each placement is made from a whole view). They heartbeat on
kvc.conductor.alive, and only the leader (`Leadership`: the lowest live id) sends re-planning role switches.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats.errors

from kvc_conductor.config import ConductorConfig
from kvc_conductor.replanning import ReplanLoop
from kvcentric.core.costmodel import CostModel
from kvcentric.core.dispatch import Submit, bad_dispatch, jobs
from kvcentric.core.protocol import (BadMessage, Cancel, ConductorAlive, Dispatch, InstancesQuery, InstancesReply,
                                     KVEventBatch, KVResync, KVSDump, KVSDumpQuery, KVSQuery, KVSReply, LoadReport,
                                     Placement, Rejection, RequestOutcome, ScheduleRequest, Subjects, TokenChunk)
from kvcentric.core.scheduling.clusters import ClusterRouter
from kvcentric.core.scheduling.conductor import Conductor
from kvcentric.core.scheduling.kvs_gate import KVSGate
from kvcentric.core.scheduling.leadership import Leadership
from kvcentric.core.scheduling.prefix import HolderIndex, prefix_from_holders
from kvcentric.core.scheduling.seeding import IndexSeeding
from kvcentric.runtime import dispatch, tracing
from kvcentric.runtime.service import Service


class KVSMetaFailed(Exception):
    """kvs-meta answered, but that it could not answer (e.g. its Redis is down)."""


KVS_ERRORS = (nats.errors.Error, asyncio.TimeoutError, BadMessage, KVSMetaFailed)
DUMP_PAGE_BLOCKS = 2000
"""Blocks asked for per page of kvs-meta's dump."""
DUMP_PAGE_TIMEOUT_S = 2.0
"""How long one page of the dump may take."""
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
        self.gate = KVSGate(config.kvs_retry_times, config.kvs_retry_interval_ms / 1000, config.kvs_down_duration_s)
        self.local_index = config.prefix_index == "local"
        self.seeding = IndexSeeding(HolderIndex(config.prefix_lease_ttl_s), config.prefix_seed_patience_s)
        self.index = self.seeding.index
        if not self.local_index:  # nothing to seed: the index stays empty and unused
            self.seeding.go_live(seeded=False)
        self.leadership = Leadership(self.instance_id, time.monotonic(), lease_s=3 * HEARTBEAT_S)
        self.started_at = time.monotonic()
        self.warm = False
        """It has heard from a prefill and a decode instance, or has run WARM_UP_S (`warmed_up`)."""
        self.replan = (ReplanLoop.from_config(self.core, self.bus, self.counters, self.log, config)
                       if config.replan_interval_s > 0 else None)

    @property
    def pending(self) -> list[tuple[float, KVEventBatch]] | None:
        """KV events that arrived while the local index is being seeded; None once it is live."""
        return self.seeding.pending

    @property
    def seeded(self) -> bool:
        return self.seeding.seeded

    async def start(self) -> None:
        if self.local_index:  # subscribed before the dump is asked for: no event falls between the two
            await self.bus.subscribe(Subjects.KV_EVENTS_ALL, KVEventBatch, self.on_kv_events)
            self.tasks.spawn(self.seed(), "seed-prefix-index")
            self.tasks.spawn(self.tasks.every(self.config.prefix_lease_ttl_s / 4, self.expire_leases),
                             "prefix-index-leases")
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
        if self.local_index:
            self.index.renew(report.instance_id, now)

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
        hits = await self.prefix_hits(request.block_hashes) if self.core.cache_aware(request) else {}
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

    async def prefix_hits(self, block_hashes: list[str]) -> dict[str, int] | None:
        """Leading blocks each instance holds; None when they cannot be known (kvs-meta down)."""
        if not block_hashes:
            return {}
        if self.local_index and self.seeding.live:
            attributes = {"kvc.block_hashes": len(block_hashes), "kvc.index": "local"}
            with tracing.span("kvs.query", attributes=attributes):
                return self.index.match(block_hashes)
        return await self.query_kvs_meta(block_hashes)

    async def query_kvs_meta(self, block_hashes: list[str]) -> dict[str, int] | None:
        """Prefix hits from one kvs-meta batch query; None when it is down."""
        if not self.gate.available(time.monotonic()):
            return None
        for _ in range(self.config.kvs_retry_times):
            try:
                holders = await self.kvs_holders(block_hashes)
            except KVS_ERRORS as exc:
                self.counters["kvs_query_failures_total"] += 1
                if self.gate.on_failure(time.monotonic()):
                    self.log.warning("kvs-meta marked down for %g s after %d failures (last: %s); "
                                     "placing by load only", self.gate.down_duration_s, self.gate.retry_times,
                                     type(exc).__name__)
                    return None
                await asyncio.sleep(self.gate.retry_interval_s)
                continue
            self.gate.on_success()
            if len(holders) != len(block_hashes):
                self.counters["kvs_short_replies_total"] += 1
            return prefix_from_holders(holders)
        return None

    async def kvs_holders(self, block_hashes: list[str]) -> list[list[str]]:
        """kvs-meta's holders of each block (the trace goes on to kvs-meta); raises one of KVS_ERRORS."""
        answer = await self.bus.request(Subjects.KVS_QUERY, KVSQuery(block_hashes=block_hashes), KVSReply,
                                        self.config.kvs_timeout_s)
        if answer.error:
            raise KVSMetaFailed(answer.error)
        return answer.holders

    # ---------------------------------------------------------------- local block index

    async def on_kv_events(self, batch: KVEventBatch) -> None:
        self.seeding.on_events(batch, time.monotonic())

    async def seed(self) -> None:
        """Apply kvs-meta's dump, then the events buffered meanwhile, then go live. When kvs-meta does not
        answer for --prefix-seed-patience-s, go live from the events alone, and ask every engine to announce
        all the blocks it holds again (kvc.kv.resync, full)."""
        self.seeding.begin(time.monotonic())
        while not await self.load_dump():
            if self.seeding.out_of_patience(time.monotonic()):
                self.counters["prefix_seed_failures_total"] += 1
                self.log.warning("kvs-meta did not answer kvc.kvs.dump for %g s: the local block index starts "
                                 "from the KV events alone", self.config.prefix_seed_patience_s)
                self.go_live(seeded=False)
                await self.bus.publish(Subjects.KV_RESYNC, KVResync(reason="a conductor's index unseeded", full=True))
                return
            await asyncio.sleep(self.gate.retry_interval_s)
        self.go_live(seeded=True)

    async def load_dump(self) -> bool:
        """Apply kvs-meta's dump page by page; False when a page did not come (the next try starts over:
        applying a page twice changes nothing, and the buffered events correct what changed meanwhile)."""
        self.seeding.restart_dump()
        while True:
            try:
                page = await self.bus.request(Subjects.KVS_DUMP,
                                              KVSDumpQuery(cursor=self.seeding.cursor, count=DUMP_PAGE_BLOCKS),
                                              KVSDump, DUMP_PAGE_TIMEOUT_S)
            except KVS_ERRORS as exc:
                self.counters["prefix_dump_failures_total"] += 1
                say = self.log.warning if isinstance(exc, BadMessage) else self.log.debug
                say("no dump page from kvs-meta at cursor %d: %s: %s", self.seeding.cursor, type(exc).__name__, exc)
                return False
            if self.seeding.apply_page(page.events, page.cursor, time.monotonic()):
                self.counters["prefix_seed_blocks_total"] += self.seeding.dump_blocks
                return True

    def go_live(self, seeded: bool) -> None:
        replayed = self.seeding.go_live(seeded)
        self.log.info("local block index live (%s): %d blocks on %d nodes, %d buffered event batches applied",
                      "seeded from kvs-meta" if seeded else "not seeded", len(self.index), self.index.nodes,
                      replayed)

    async def expire_leases(self) -> None:
        for node_id in self.index.expire(time.monotonic()):
            self.counters["prefix_index_nodes_purged_total"] += 1
            self.log.info("no word from %s for %g s: dropped it from the local block index", node_id,
                          self.index.lease_ttl_s)

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
        now = time.monotonic()
        return {"prefill_alive": len(self.registry.alive_prefill(now)),
                "decode_alive": len(self.registry.alive_decode(now)),
                "policy": self.config.policy, "rejection": self.config.rejection, "slos": self.core.slo_view(now),
                "burst_s": self.config.bursts_s,
                "kvs_metadata_down": self.gate.is_down(now), "cost_model": self.core.estimator.cost.source,
                "prefix_index": self.config.prefix_index,
                "conductors": self.leadership.replicas(now), "leader": self.leadership.leader(now),
                **({"prefix_index_live": self.seeding.live, "prefix_index_seeded": self.seeded}
                   if self.local_index else {}),
                **({"prfaas": self.core.router.status(self.core.prefill_views(now), now)}
                   if self.core.router is not None else {}),
                **({"replan": self.replan.status()} if self.replan is not None else {}),
                "instances": self.cost_view(now)}

    def cost_view(self, now: float) -> dict[str, dict]:
        """Per alive instance: where its cost model comes from, its fit error, and its latest timed prefill chunk
        and decode step against what its model and the prior predict."""
        roles: dict[str, list[str]] = {}
        for info in self.registry.snapshot(now):
            roles.setdefault(info.instance_id, []).append(info.role)
        return {instance_id: self.core.models.view(instance_id, names) for instance_id, names in roles.items()}

    def gauges(self) -> dict[str, float]:
        stats, outcomes = self.core.stats, self.core.stats["outcomes"]
        gauges = {"kvs_metadata_down": float(self.gate.is_down(time.monotonic())),
                  "kvs_marked_down_total": float(self.gate.times_marked_down),
                  "decode_time_estimate_s": self.core.t_d,
                  "placements_pulling_total": float(stats["pulls"]),
                  "pulled_blocks_total": float(stats["pulled_blocks"]),
                  "rejections_prefill_total": float(stats["rejected_prefill"]),
                  "rejections_decode_total": float(stats["rejected_decode"]),
                  "probes_total": float(stats["probes"]),
                  "burst_queued_total": float(stats["queued_burst"]),
                  "burst_offered_per_instance_s": self.core.offered.per_instance_s,
                  "ttft_outcomes_total": float(outcomes),
                  "heartbeats_missed_total": float(self.registry.missed_beats),
                  "liveness_only_reports_total": float(self.registry.repeats),
                  "placements_in_flight": float(sum(len(s.in_flight) for s in self.registry.prefill.values())),
                  "prefill_queue_s_max": max((s.queue_s(time.monotonic()) for s in self.registry.prefill.values()),
                                             default=0.0)}
        if self.core.expected is not None:
            gauges["expected_prompts"] = float(len(self.core.expected))
        if self.local_index:
            gauges.update({"prefix_index_blocks": float(len(self.index)),
                           "prefix_index_nodes": float(self.index.nodes), "prefix_index_seeded": float(self.seeded),
                           "prefix_index_events_applied_total": float(self.index.events_applied)})
        if self.core.router is not None:
            gauges.update(self.prfaas_gauges(self.core.router))
        if outcomes:
            gauges["ttft_prediction_error_mean_s"] = stats["ttft_error_sum_s"] / outcomes
            gauges["ttft_prediction_abs_error_mean_s"] = stats["ttft_abs_error_sum_s"] / outcomes
            gauges["ttft_prediction_rel_error_mean"] = stats["ttft_rel_error_sum"] / outcomes
        gauges.update(self.tbt_gauges())
        gauges.update(self.correction_gauges())
        return gauges

    def correction_gauges(self) -> dict[str, float]:
        """Each alive prefill instance's TTFT correction as admission applies it now (1: none)."""
        correction = self.core.correction
        if correction is None:
            return {}
        now = time.monotonic()
        gauges = {"ttft_correction_observations_total": float(correction.observations)}
        for state in self.registry.alive_prefill(now):
            gauges[f'ttft_correction{{prefill="{state.instance_id}"}}'] = correction.factor(state.instance_id, now)
        return gauges

    def tbt_gauges(self) -> dict[str, float]:
        """Predicted decode step at placement against each request's mean time between tokens, and how many
        placements no trusted model judged."""
        stats, outcomes = self.core.stats, self.core.stats["tbt_outcomes"]
        gauges = {"tbt_outcomes_total": float(outcomes), "placements_unjudged_total": float(stats["placed_unjudged"])}
        if outcomes:
            gauges["tbt_prediction_error_mean_s"] = stats["tbt_error_sum_s"] / outcomes
            gauges["tbt_prediction_abs_error_mean_s"] = stats["tbt_abs_error_sum_s"] / outcomes
            gauges["tbt_prediction_rel_error_mean"] = stats["tbt_rel_error_sum"] / outcomes
        return gauges

    def prfaas_gauges(self, router: ClusterRouter) -> dict[str, float]:
        now = time.monotonic()
        status = router.status(self.core.prefill_views(now), now)
        gauges = {"prfaas_threshold_tokens": router.threshold,
                  "prfaas_routed_local_total": float(router.stats["routed_pd"]),
                  "prfaas_routed_remote_total": float(router.stats["routed_prfaas"]),
                  "prfaas_cross_cluster_transfers_total": float(router.stats["cross_cluster_transfers"]),
                  "prfaas_threshold_changes_total": float(router.stats["threshold_changes"]),
                  "prfaas_threshold_rederived_total": float(router.stats["threshold_rederived"])}
        for cluster, value in status["egress_utilization"].items():
            gauges[f'prfaas_egress_utilization{{cluster="{cluster}"}}'] = value
        return gauges
