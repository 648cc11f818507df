"""The conductor's long-term re-planning loop (PrfaaS §3.4.3), the I/O around `kvcentric.core.prfaas.replan`.

Every `--replan-interval-s` it samples the PD cluster's prefill and decode pools from the registry; when
`Replanner` finds one pool the bottleneck over `--replan-window-s`, it sends a `RoleSwitch` on
`kvc.control.<id>` to the least-loaded instance of the other pool (the engine drains and serves on in the
new role). With a PrfaaS topology and `--replan-profile` (the planner's profile), once the new split shows
in the load reports it re-plans t with `planner.best_threshold` over the uncached lengths it has recently
placed, and the router's short-term steps return toward that t. It decides nothing per request.
"""

from __future__ import annotations

import collections
import time

import nats.errors

from kvcentric.core.prfaas.planner import best_threshold
from kvcentric.core.prfaas.profile import PrfaasProfile
from kvcentric.core.prfaas.replan import ReplanPolicy, Replanner, Switch
from kvcentric.core.prfaas.throughput import Counts
from kvcentric.core.prfaas.workload import LengthDistribution
from kvcentric.core.protocol import BadMessage, Placement, RoleSwitch, ScheduleRequest, Subjects, SubmitAck

RECENT_REQUESTS = 2000
"""Placed requests whose uncached and output lengths make the empirical workload of a t re-plan."""


class ReplanLoop:
    def __init__(self, service, config) -> None:
        self.service, self.core = service, service.core
        policy = ReplanPolicy(window_s=config.replan_window_s, imbalance=config.replan_imbalance)
        self.planner = Replanner(policy, config.replan_bs_max, config.decode_time_s)
        self.profile = PrfaasProfile.load(config.replan_profile) if config.replan_profile else None
        self.lengths: collections.deque[tuple[int, int]] = collections.deque(maxlen=RECENT_REQUESTS)
        self.expected: tuple[int, int] | None = None
        """(N_p, N_d) a switch asked for; t is re-planned once the load reports show it."""
        self.switches: list[dict] = []

    def placed(self, request: ScheduleRequest, placement: Placement) -> None:
        self.lengths.append((request.n_tokens - placement.cached_tokens, request.max_tokens))

    def pools(self, now: float) -> tuple[list, list]:
        """The PD cluster's serving prefill and decode instances (all of them without a topology)."""
        prefill, decode = self.core.registry.alive_prefill(now), self.core.registry.alive_decode(now)
        router = self.core.router
        if router is not None:
            prefill, decode = router.in_scope(prefill, router.pd), router.in_scope(decode, router.pd)
        colocated = {s.instance_id for s in prefill} & {s.instance_id for s in decode}
        return ([s for s in prefill if s.instance_id not in colocated],
                [s for s in decode if s.instance_id not in colocated])

    async def tick(self) -> None:
        now = time.monotonic()
        prefill, decode = self.pools(now)
        self.planner.observe(prefill, decode, now)
        self.retune_threshold(len(prefill), len(decode), now)
        switch = self.planner.decide(prefill, decode, now)
        if switch is not None:
            await self.apply(switch)

    async def apply(self, switch: Switch) -> None:
        change = switch.change
        self.service.log.info("re-planning: %s; switching %s to %s", change.reason, ", ".join(switch.instance_ids),
                              switch.to_role)
        for instance_id in switch.instance_ids:
            try:
                command = RoleSwitch(role=switch.to_role, reason=change.reason)
                ack = await self.service.request(Subjects.control(instance_id), command, SubmitAck, timeout_s=2.0)
            except (nats.errors.Error, TimeoutError, BadMessage) as exc:
                ack = SubmitAck.refused(f"{type(exc).__name__}: {exc}")
            self.service.counters[f"role_switches_{'sent' if ack.ok else 'failed'}_total"] += 1
            if not ack.ok:
                self.service.log.warning("%s did not take the role switch: %s", instance_id, ack.error)
            self.switches.append({"instance": instance_id, "to": switch.to_role, "ok": ack.ok,
                                  "reason": change.reason})
        self.expected = (change.n_prefill, change.n_decode)

    def retune_threshold(self, n_prefill: int, n_decode: int, now: float) -> None:
        """Once the split a switch asked for is in place: t = best_threshold for it (PrfaaS only)."""
        router = self.core.router
        if self.expected is None or (n_prefill, n_decode) != self.expected:
            return
        self.expected = None
        if router is None or self.profile is None or not router.prfaas or not self.lengths:
            return
        n_prfaas = len([s for s in self.core.registry.alive_prefill(now) if s.cluster in router.prfaas])
        uncached, outputs = zip(*self.lengths)
        workload = LengthDistribution.from_samples([max(1, n) for n in uncached], sum(outputs) / len(outputs),
                                                   "recently placed requests")
        point = best_threshold(self.profile, workload, Counts(n_prfaas, n_prefill, n_decode))
        router.replan(point.threshold, f"re-planned for N_prfaas/N_p/N_d = {n_prfaas}/{n_prefill}/{n_decode}")
        self.service.log.info("re-planned t = %.0f tokens for N_prfaas/N_p/N_d = %d/%d/%d (Λ_max %.3g req/s)",
                              point.threshold, n_prfaas, n_prefill, n_decode, point.lambda_max)

    def status(self) -> dict:
        last = self.planner.last
        return {"last_decision": last.reason if last is not None else "none yet",
                "action": last.action if last is not None else "none", "switches": self.switches[-10:]}
