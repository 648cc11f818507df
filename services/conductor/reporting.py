"""What the conductor shows of itself: its /health body (instances alive, SLOs, the prefix index, replicas, PrfaaS
routing, each instance's cost model) and its /metrics gauges (prediction errors, corrections, rejections). It
reads the Conductor core and the service's parts; it decides and changes nothing.
"""

from __future__ import annotations

from kvc_conductor.config import ConductorConfig
from kvc_conductor.prefixes import PrefixHits
from kvc_conductor.replanning import ReplanLoop
from kvcentric.core.scheduling.clusters import ClusterRouter
from kvcentric.core.scheduling.conductor import Conductor
from kvcentric.core.scheduling.leadership import Leadership


class Reporting:
    """The conductor's health and gauges, as of the time each is asked for."""

    def __init__(self, config: ConductorConfig, core: Conductor, prefixes: PrefixHits, leadership: Leadership,
                 replan: ReplanLoop | None) -> None:
        self.config, self.core, self.prefixes, self.leadership, self.replan = config, core, prefixes, leadership, replan

    def health(self, now: float) -> dict:
        core, registry, seeding = self.core, self.core.registry, self.prefixes.seeding
        return {"prefill_alive": len(registry.alive_prefill(now)),
                "decode_alive": len(registry.alive_decode(now)),
                "policy": self.config.policy, "rejection": self.config.rejection, "slos": core.slo_view(now),
                "burst_s": self.config.bursts_s,
                "kvs_metadata_down": self.prefixes.gate.is_down(now), "cost_model": core.estimator.cost.source,
                "prefix_index": self.config.prefix_index,
                "conductors": self.leadership.replicas(now), "leader": self.leadership.leader(now),
                **({"prefix_index_live": seeding.live, "prefix_index_seeded": seeding.seeded}
                   if self.prefixes.local else {}),
                **({"prfaas": core.router.status(core.prefill_views(now), now)} if core.router is not None else {}),
                **({"replan": self.replan.status()} if self.replan is not None else {}),
                "instances": self.cost_view(now)}

    def cost_view(self, now: float) -> dict[str, dict]:
        """Per alive instance: where its cost model comes from, its fit error, and its latest timed prefill chunk
        and decode step against what its model and the prior predict."""
        roles: dict[str, list[str]] = {}
        for info in self.core.registry.snapshot(now):
            roles.setdefault(info.instance_id, []).append(info.role)
        return {instance_id: self.core.models.view(instance_id, names) for instance_id, names in roles.items()}

    def gauges(self, now: float) -> dict[str, float]:
        core, registry = self.core, self.core.registry
        stats, outcomes = core.stats, core.stats["outcomes"]
        gauges = {"kvs_metadata_down": float(self.prefixes.gate.is_down(now)),
                  "kvs_marked_down_total": float(self.prefixes.gate.times_marked_down),
                  "decode_time_estimate_s": core.t_d,
                  "placements_pulling_total": float(stats["pulls"]),
                  "pulled_blocks_total": float(stats["pulled_blocks"]),
                  "placements_pulling_from_decode_total": float(stats["pulls_from_decode"]),
                  "rejections_prefill_total": float(stats["rejected_prefill"]),
                  "rejections_decode_total": float(stats["rejected_decode"]),
                  "probes_total": float(stats["probes"]),
                  "burst_queued_total": float(stats["queued_burst"]),
                  "burst_offered_per_instance_s": core.offered.per_instance_s,
                  "ttft_outcomes_total": float(outcomes),
                  "heartbeats_missed_total": float(registry.missed_beats),
                  "liveness_only_reports_total": float(registry.repeats),
                  "placements_in_flight": float(sum(len(s.in_flight) for s in registry.prefill.values())),
                  "prefill_queue_s_max": max((s.queue_s(now) for s in registry.prefill.values()), default=0.0)}
        if core.expected is not None:
            gauges["expected_prompts"] = float(len(core.expected))
        gauges.update(self.prefixes.gauges())
        if core.router is not None:
            gauges.update(self.prfaas_gauges(core.router, now))
        if outcomes:
            gauges["ttft_prediction_error_mean_s"] = stats["ttft_error_sum_s"] / outcomes
            gauges["ttft_prediction_abs_error_mean_s"] = stats["ttft_abs_error_sum_s"] / outcomes
            gauges["ttft_prediction_rel_error_mean"] = stats["ttft_rel_error_sum"] / outcomes
        gauges.update(self.tbt_gauges())
        gauges.update(self.correction_gauges(now))
        return gauges

    def correction_gauges(self, now: float) -> dict[str, float]:
        """Each alive prefill instance's TTFT correction as admission applies it now (1: none)."""
        correction = self.core.correction
        if correction is None:
            return {}
        gauges = {"ttft_correction_observations_total": float(correction.observations)}
        for state in self.core.registry.alive_prefill(now):
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

    def prfaas_gauges(self, router: ClusterRouter, now: float) -> dict[str, float]:
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
