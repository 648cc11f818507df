"""Settings of the conductor service (flags and KVC_* environment variables): the bus, the scheduling core
(`kvcentric.core.scheduling.config.SchedulerConfig`), the cost model, where prefix hits come from (the local
block index or kvs-meta lookups) and the PrfaaS topology and threshold."""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from kvcentric.config import BusConfig, ConfigError, require, setting
from kvcentric.core.costmodel import HARDWARE, CostModel, load_cost_model
from kvcentric.core.prfaas.inputs import InputError
from kvcentric.core.prfaas.profile import PrfaasProfile
from kvcentric.core.prfaas.topology import Topology
from kvcentric.core.scheduling.clusters import ClusterSetup
from kvcentric.model.config import load_model_config
from kvcentric.core.scheduling.config import SchedulerConfig


DEFAULT_BURST_S = 60.0
"""--burst-s -1 with a relative TTFT SLO: bursts the prefill pool clears within a minute are queued."""
PrefixIndex = Literal["local", "kvs-meta"]
"""Where prefix hits come from (`--prefix-index`)."""
CostSource = Literal["measured", "prior"]
"""What predicts each instance's times (`--cost-source`)."""


@dataclasses.dataclass(frozen=True)
class ConductorConfig(BusConfig, SchedulerConfig):
    ttft_slo_s: float = setting(0.0, "TTFT SLO in seconds (a request predicted above it is rejected); 0: relative, "
                                     "--ttft-slo-factor (10) x the unloaded prefill time of the request's prompt, "
                                     "from the fastest measured model of the prefill pool")
    tbt_slo_s: float = setting(0.0, "TBT SLO in seconds (time between tokens); 0: relative, --tbt-slo-factor (5) x "
                                    "the unloaded decode step (one sequence, the prompt's context), from the fastest "
                                    "measured model of the decode pool")
    burst_s: float = setting(-1.0, "a burst of requests is queued, not refused, while the prefill work offered "
                                   "lately (a bucket drained at the pool's capacity) is at most this many seconds "
                                   "per prefill instance: a request is then admitted while its predicted TTFT is "
                                   "within this, its SLO or not; a sustained rate above capacity fills the bucket "
                                   "and the TTFT SLO alone judges (0: always, the paper's admission; -1: 60 with a "
                                   "relative TTFT SLO, 0 with --ttft-slo-s, an SLO the operator holds requests to)")
    probe_every_s: float = setting(5.0, "an idle prefill instance refused work on its prediction (over the TTFT "
                                        "SLO) for this long, with nothing placed there, is given one request (a "
                                        "probe), so it is measured again instead of refused for ever on a stale "
                                        "estimate (0: never)")
    slo_headroom: float = setting(0.1, "admit only while the predicted load is at most (1 - this) x its threshold: "
                                       "a margin for predictions that run short as the load grows (0: admit up "
                                       "to the SLO itself, as the simulator does by default)")
    stale_after_s: float = setting(1.5, "an instance with no load report for this long is dead: out of placement "
                                        "(engines report from a heartbeat thread, busy or not)")
    stuck_after_s: float = setting(10.0, "an instance whose event loop has computed no load for this long (its "
                                         "heartbeat alone still beats) is out of placement too: a loop held "
                                         "that long would not take a job within --submit-timeout-s either")
    profile: str = setting("", "cost model JSON written by `kvcentric profile`: the prior of every instance "
                               "until it reports its own measured model, trusted to reject (default: a roofline "
                               "of --model on --hardware, which only ranks)")
    model: str = setting("tiny", "model (preset or checkpoint directory) of the roofline cost model when no "
                                 "--profile is given")
    hardware: str = setting("cpu-2core", f"hardware preset for the roofline: {', '.join(HARDWARE)}")
    cost_source: CostSource = setting(
        "measured", "measured: each instance's times are predicted by the cost model it measured of itself (sent "
                    "with its load reports), the --profile or roofline until then; prior: by the --profile or "
                    "roofline always, trusted to reject (measurements ignored)")
    kvs_retry_times: int = setting(5, "consecutive failed kvs-meta lookups that mark it down")
    kvs_retry_interval_ms: int = setting(100, "pause between two attempts of one lookup")
    kvs_timeout_s: float = setting(0.2, "how long one kvs-meta lookup may take")
    kvs_down_duration_s: float = setting(30.0, "after being marked down, kvs-meta is not asked for this long "
                                               "(placement is load-only meanwhile)")
    prefix_index: PrefixIndex = setting(
        "local", "where prefix hits come from: local (a mirror of kvs-meta's block index kept from the KV "
                 "events, seeded from kvs-meta at start; no lookup per request) or kvs-meta (one "
                 "kvc.kvs.query per request)")
    prefix_lease_ttl_s: float = setting(5.0, "local index: a node not heard from (KV events, load reports) for "
                                             "this long is dropped from it, as kvs-meta's --lease-ttl-s")
    prefix_seed_patience_s: float = setting(10.0, "local index: how long to keep asking kvs-meta for its index "
                                                  "at start before going on from the KV events alone (prefix "
                                                  "hits come from kvs-meta lookups meanwhile)")
    submit_timeout_s: float = setting(5.0, "when the conductor hands a placed request to its engines itself "
                                           "(the gateway's --dispatch conductor): how long an engine may take "
                                           "to take the job before the request fails with 503")
    topology: str = setting("", "PrfaaS topology (JSON/YAML: clusters with role pd|prfaas, links with gbps); "
                                "with a prfaas cluster, long uncached prefills go there (default: one cluster)")
    prfaas_threshold: int = setting(0, "PrfaaS: planned threshold t, uncached tokens above which a request "
                                       "prefills in the prfaas cluster (`kvcentric plan` finds it)")
    prfaas_adjust_s: float = setting(1.0, "PrfaaS: seconds between short-term steps of t from the measured "
                                          "egress use and queues (0: t stays at --prfaas-threshold)")
    replan_interval_s: float = setting(0.0, "long-term re-planning (PrfaaS §3.4.3): seconds between looks at "
                                            "the prefill and decode pools; when one is the bottleneck over "
                                            "--replan-window-s an instance of the other switches role (0: off)")
    replan_window_s: float = setting(60.0, "re-planning: the window pool loads are averaged over, and the pause "
                                           "after a switch")
    replan_imbalance: float = setting(1.25, "re-planning: switch only when one pool's pressure is this many "
                                            "times the other's")
    replan_bs_max: int = setting(64, "re-planning: decode batch slots per instance (the engines' --max-batch)")
    replan_profile: str = setting("", "with --topology: the planner's profile (`kvcentric plan --profile`); "
                                      "after a role change t is re-planned with it for the new counts, and a "
                                      "short-term trigger (--prfaas-adjust-s) re-derives t with it at the measured "
                                      "egress bandwidth, both over recently placed uncached lengths (PrfaaS "
                                      "§3.4.3; without it t moves in x1.25 steps)")
    prfaas_profile: str = setting("", "PrfaaS: cost model JSON of the prfaas cluster's hardware (default: "
                                      "the same as the local one)")

    def __post_init__(self) -> None:
        BusConfig.__post_init__(self)
        SchedulerConfig.__post_init__(self)
        require(self.stale_after_s > 0, "stale_after_s", "must be positive")
        require(self.stuck_after_s > 0, "stuck_after_s", "must be positive")
        if not self.profile:
            try:
                load_model_config(self.model)
            except ValueError as exc:
                raise ConfigError(f"--model: {exc}") from None
        require(self.hardware in HARDWARE, "hardware", f"choose a preset: {', '.join(HARDWARE)}")
        require(self.cost_source in get_args(CostSource), "cost_source",
                f"choose {' or '.join(get_args(CostSource))}, got {self.cost_source!r}")
        require(self.kvs_retry_times >= 1, "kvs_retry_times", "must be at least 1")
        require(self.kvs_retry_interval_ms >= 0, "kvs_retry_interval_ms", "must be >= 0")
        require(self.kvs_timeout_s > 0, "kvs_timeout_s", "must be positive")
        require(self.submit_timeout_s > 0, "submit_timeout_s", "must be positive")
        require(self.kvs_down_duration_s >= 0, "kvs_down_duration_s", "must be >= 0")
        require(self.prefix_index in get_args(PrefixIndex), "prefix_index",
                f"choose {' or '.join(get_args(PrefixIndex))}, got {self.prefix_index!r}")
        require(self.prefix_lease_ttl_s > 0, "prefix_lease_ttl_s", "must be positive")
        require(self.prefix_seed_patience_s >= 0, "prefix_seed_patience_s", "must be >= 0")
        require(self.replan_interval_s >= 0, "replan_interval_s", "must be >= 0 (0: off)")
        require(self.replan_window_s > 0, "replan_window_s", "must be positive")
        require(self.replan_imbalance >= 1, "replan_imbalance", "must be at least 1")
        require(self.replan_bs_max >= 1, "replan_bs_max", "must be at least 1")
        if self.replan_profile:
            try:
                PrfaasProfile.load(self.replan_profile)
            except InputError as exc:
                raise ConfigError(f"--replan-profile: {exc}") from None
        require(self.prfaas_threshold >= 0, "prfaas_threshold", "must be 0 or more tokens")
        require(self.prfaas_adjust_s >= 0, "prfaas_adjust_s", "must be >= 0")
        if self.topology:
            self.clusters()  # reads the file and checks --cluster against it

    def clusters(self, prfaas_cost: CostModel | None = None) -> ClusterSetup | None:
        """The PrfaaS routing set-up from --topology (None without one); errors name the flag."""
        if not self.topology:
            return None
        try:
            topology = Topology.load(self.topology)
        except InputError as exc:
            raise ConfigError(f"--topology: {exc}") from None
        if self.cluster not in [c.name for c in topology.of_role("pd")]:
            raise ConfigError(f"--cluster: {self.cluster!r} must name a pd cluster of --topology "
                              f"{self.topology} (pd clusters: {', '.join(c.name for c in topology.of_role('pd'))})")
        costs = {name: prfaas_cost for name in (c.name for c in topology.of_role("prfaas"))} if prfaas_cost else {}
        profile = PrfaasProfile.load(self.replan_profile) if self.replan_profile else None
        return ClusterSetup(topology, self.cluster, float(self.prfaas_threshold), self.prfaas_adjust_s, costs=costs,
                            profile=profile)

    def cost_model(self) -> CostModel:
        """What predicts prefill and decode times: the --profile file, else the roofline of --model on
        --hardware."""
        return load_cost_model(self.profile, self.model, self.hardware)

    @property
    def prior_trusted(self) -> bool:
        """Whether the prior may reject: it is a profile someone made, or the operator chose it over measurement."""
        return bool(self.profile) or self.cost_source == "prior"

    @property
    def scheduler(self) -> SchedulerConfig:
        """The core's part of these settings (--burst-s -1 resolved)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulerConfig)}
        return SchedulerConfig(**{**fields, "burst_s": self.bursts_s})

    @property
    def bursts_s(self) -> float:
        """--burst-s, or for -1: DEFAULT_BURST_S with a relative TTFT SLO, none with an absolute one."""
        if self.burst_s >= 0:
            return self.burst_s
        return 0.0 if self.ttft_slo_s > 0 else DEFAULT_BURST_S
