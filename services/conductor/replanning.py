"""The conductor's long-term re-planning loop (PrfaaS §3.4.3): the asyncio side of
`kvcentric.core.prfaas.replan` and `kvcentric.core.prfaas.replanning`.

Every `--replan-interval-s` it samples the PD cluster's prefill and decode pools from the registry; when
`Replanner` finds one pool the bottleneck over `--replan-window-s`, it sends a `RoleSwitch` on
`kvc.control.<id>` to the least-loaded instance of the other pool (the engine drains and serves on in the
new role). With a PrfaaS topology and `--replan-profile` (the planner's profile), once the new split shows
in the load reports the router's t is re-planned for it, and the router's short-term steps return toward
that t. It decides nothing per request.
"""

from __future__ import annotations

import collections
import logging
import time

import nats.errors

from kvc_conductor.config import ConductorConfig
from kvcentric.core.prfaas.profile import PrfaasProfile
from kvcentric.core.prfaas.replan import ReplanPolicy, Replanner, Switch
from kvcentric.core.prfaas.replanning import ThresholdRetuner, pd_pools, prfaas_instances
from kvcentric.core.protocol import BadMessage, Placement, RoleSwitch, ScheduleRequest, Subjects, SubmitAck
from kvcentric.core.scheduling.conductor import Conductor
from kvcentric.runtime.bus import Bus

SWITCH_TIMEOUT_S = 2.0
"""How long an engine may take to acknowledge a role switch."""


class ReplanLoop:
    """Feeds the pools to `Replanner`, sends the role switches it decides, and re-plans t afterwards."""

    def __init__(self, core: Conductor, bus: Bus, counters: collections.Counter[str], log: logging.Logger,
                 planner: Replanner, retuner: ThresholdRetuner) -> None:
        self.core, self.bus, self.counters, self.log = core, bus, counters, log
        self.planner, self.retuner = planner, retuner
        self.switches: list[dict] = []

    @classmethod
    def from_config(cls, core: Conductor, bus: Bus, counters: collections.Counter[str], log: logging.Logger,
                    config: ConductorConfig) -> ReplanLoop:
        policy = ReplanPolicy(window_s=config.replan_window_s, imbalance=config.replan_imbalance)
        profile = PrfaasProfile.load(config.replan_profile) if config.replan_profile else None
        return cls(core, bus, counters, log, Replanner(policy, config.replan_bs_max, config.decode_time_s),
                   ThresholdRetuner(profile))

    @property
    def expected(self) -> tuple[int, int] | None:
        """(N_p, N_d) the last switch asked for, until the load reports show it."""
        return self.retuner.expected

    def placed(self, request: ScheduleRequest, placement: Placement) -> None:
        self.retuner.placed(request.n_tokens - placement.cached_tokens, request.max_tokens)

    async def tick(self, leads: bool = True) -> None:
        """Sample the pools and re-plan t; decide and send a role switch only when `leads` (one conductor
        replica of several does)."""
        now = time.monotonic()
        registry = self.core.registry
        prefill, decode = pd_pools(registry.alive_prefill(now), registry.alive_decode(now), self.core.router)
        self.planner.observe(prefill, decode, now)
        self.retune_threshold(len(prefill), len(decode), now)
        if not leads:
            return
        switch = self.planner.decide(prefill, decode, now)
        if switch is not None:
            await self.apply(switch)

    async def apply(self, switch: Switch) -> None:
        change = switch.change
        self.log.info("re-planning: %s; switching %s to %s", change.reason, ", ".join(switch.instance_ids),
                      switch.to_role)
        for instance_id in switch.instance_ids:
            ack = await self.send_switch(instance_id, RoleSwitch(role=switch.to_role, reason=change.reason))
            self.counters[f"role_switches_{'sent' if ack.ok else 'failed'}_total"] += 1
            if not ack.ok:
                self.log.warning("%s did not take the role switch: %s", instance_id, ack.error)
            self.switches.append({"instance": instance_id, "to": switch.to_role, "ok": ack.ok,
                                  "reason": change.reason})
        self.retuner.expect(change.n_prefill, change.n_decode)

    async def send_switch(self, instance_id: str, command: RoleSwitch) -> SubmitAck:
        """The engine's ack, or a failed one that says why none came."""
        try:
            return await self.bus.request(Subjects.control(instance_id), command, SubmitAck, SWITCH_TIMEOUT_S)
        except (nats.errors.Error, TimeoutError, BadMessage) as exc:
            return SubmitAck(ok=False, error=f"{type(exc).__name__}: {exc}")

    def retune_threshold(self, n_prefill: int, n_decode: int, now: float) -> None:
        """Once the split a switch asked for is in place: t = best_threshold for it (PrfaaS only)."""
        router = self.core.router
        n_prfaas = prfaas_instances(self.core.registry.alive_prefill(now), router)
        point = self.retuner.retune(n_prefill, n_decode, n_prfaas)
        if point is None or router is None:  # no router, no PrfaaS cluster: retune has no point either
            return
        router.replan(point.threshold, f"re-planned for N_prfaas/N_p/N_d = {n_prfaas}/{n_prefill}/{n_decode}")
        self.log.info("re-planned t = %.0f tokens for N_prfaas/N_p/N_d = %d/%d/%d (Λ_max %.3g req/s)",
                      point.threshold, n_prfaas, n_prefill, n_decode, point.lambda_max)

    def status(self) -> dict:
        last = self.planner.last
        return {"last_decision": last.reason if last is not None else "none yet",
                "action": last.action if last is not None else "none", "switches": self.switches[-10:]}
