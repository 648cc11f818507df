"""Settings of the Conductor core, shared by the live conductor service and the simulator (each field is
a flag of both: `--policy`, `--rejection`, `--ttft-slo-s`, ...). It holds values; it decides nothing."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, get_args

from kvcentric.config import require, setting
from kvcentric.core.scheduling.admission import RejectionMode
from kvcentric.core.scheduling.policies import PlacementName
from kvcentric.core.scheduling.slo import TBT_FACTOR, TTFT_FACTOR, SloPolicy

QueueTime = Literal["reported", "tokens"]
"""Where a prefill instance's T_queue comes from (`--queue-time`)."""


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    policy: PlacementName = setting("kvcentric", "prefill placement policy (kvcentric = Mooncake Algorithm 1)")
    rejection: RejectionMode = setting(
        "early", "overload rejection (Mooncake §7; none: each stage on its own, on arrival; never: admit all)")
    ttft_slo_s: float = setting(30.0, "TTFT SLO in seconds (a request predicted above it is rejected); 0: relative, "
                                      "--ttft-slo-factor x the unloaded prefill time of the request's prompt, from "
                                      "the fastest measured model of the prefill pool")
    tbt_slo_s: float = setting(0.1, "TBT SLO in seconds (time between tokens); 0: relative, --tbt-slo-factor x the "
                                    "unloaded decode step (one sequence, the prompt's context), from the fastest "
                                    "measured model of the decode pool")
    ttft_slo_factor: float = setting(TTFT_FACTOR, "with --ttft-slo-s 0: the TTFT SLO is this x the unloaded prefill "
                                                  "time of the prompt")
    tbt_slo_factor: float = setting(TBT_FACTOR, "with --tbt-slo-s 0: the TBT SLO is this x the unloaded decode step")
    burst_s: float = setting(0.0, "a burst of requests is queued, not refused, while the prefill work offered "
                                  "lately (a bucket drained at the pool's capacity) is at most this many seconds per "
                                  "prefill instance: a request is then admitted while its predicted TTFT is within "
                                  "this, its SLO or not; a sustained rate above capacity fills the bucket and the "
                                  "TTFT SLO alone judges (0: always, the paper's admission)")
    probe_every_s: float = setting(0.0, "an idle prefill instance refused work on its prediction (over the TTFT "
                                        "SLO) for this long, with nothing placed there, is given one request (a "
                                        "probe), so it is measured again instead of refused for ever on a stale "
                                        "estimate (0: never)")
    kvcache_balancing_threshold: float = setting(
        2.0, "pull the best prefix from another instance when it is longer than this many times the local one")
    block_size: int = setting(16, "tokens per prefix-hash block (the engines' KV block size; 512 in Mooncake traces)")
    link_gbps: float = setting(100.0, "KV transfer bandwidth between two instances, Gbit/s, when not measured")
    decode_time_s: float = setting(10.0, "uniform decode duration t_d of predictive rejection (initial value)")
    adapt_decode_time: bool = setting(True, "follow the observed decode durations (moving average) for t_d")
    priority_step: float = setting(0.2, "each priority class below --top-priority is rejected this much load earlier")
    top_priority: int = setting(0, "requests at or above this priority are held to the SLO itself")
    slo_headroom: float = setting(0.0, "admit only while the predicted load is at most (1 - this) x its threshold: "
                                       "a margin for predictions that run short as the load grows (0: admit up "
                                       "to the SLO itself)")
    seed: int = setting(0, "seed of the random policy")
    cache_aware_scheduling_min_tokens: int = setting(
        0, "prompts shorter than this are placed by load alone, their prefix hits ignored (Llumnix "
           "--cache-aware-scheduling-min-tokens, 1024 there; 0: every prompt is placed cache-aware)")
    queue_time: QueueTime = setting(
        "reported", "T_queue of a prefill instance: reported = the sum of its queued prefills' predicted times, as "
                    "it reports it, plus the placements its reports do not list yet (Mooncake §6.1); tokens = a "
                    "linear guess from its raw queued tokens, placements forgotten at each report (the estimate "
                    "before instances reported one)")
    expect_cache: bool = setting(True, "on placement, expect the chosen prefill instance to hold the prompt's "
                                       "blocks before its KV events say so (Mooncake §6.1)")
    ttft_correction: bool = setting(True, "admission and placement (kvcentric, cache_aware) multiply each "
                                          "prefill instance's predicted TTFT by the "
                                          "ratio of actual to predicted TTFT learned from its first tokens "
                                          "(exponentially weighted, clamped to [0.5, 4]), raised to the ratio its "
                                          "latest prefill chunks ran at against its own model and to what its "
                                          "placements still waiting for a first token show already")
    ttft_correction_spread: float = setting(1.0, "with --ttft-correction: the learned ratio and the prefill chunks' "
                                                 "ratio are each their weighted mean plus this many weighted mean "
                                                 "deviations (as TCP's retransmission timeout; 0: the mean alone)")

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "tbt_slo_s"):
            value = getattr(self, name)
            require(math.isfinite(value) and value >= 0, name, "must be 0 (relative) or positive")
        require(self.ttft_slo_factor > 0, "ttft_slo_factor", "must be positive")
        require(self.tbt_slo_factor > 0, "tbt_slo_factor", "must be positive")
        require(math.isfinite(self.burst_s) and (self.burst_s >= 0 or self.burst_s == -1), "burst_s",
                "must be 0 (none), positive, or -1 (the conductor's default: by the TTFT SLO)")
        require(math.isfinite(self.probe_every_s) and self.probe_every_s >= 0, "probe_every_s", "must be 0 or more")
        require(self.kvcache_balancing_threshold >= 1, "kvcache_balancing_threshold", "must be >= 1")
        require(self.block_size >= 1, "block_size", "must be at least 1")
        require(self.link_gbps > 0, "link_gbps", "must be positive")
        require(self.decode_time_s > 0, "decode_time_s", "must be positive")
        require(0 <= self.priority_step <= 1, "priority_step", "must be in [0, 1]")
        require(0 <= self.slo_headroom < 1, "slo_headroom", "must be in [0, 1)")
        require(math.isfinite(self.ttft_correction_spread) and self.ttft_correction_spread >= 0,
                "ttft_correction_spread", "must be 0 or more")
        require(self.cache_aware_scheduling_min_tokens >= 0, "cache_aware_scheduling_min_tokens", "must be >= 0")
        require(self.queue_time in get_args(QueueTime), "queue_time",
                f"choose {' or '.join(get_args(QueueTime))}, got {self.queue_time!r}")

    @property
    def slos(self) -> SloPolicy:
        """The SLOs: absolute where set, else relative to the unloaded speed."""
        return SloPolicy(self.ttft_slo_s, self.tbt_slo_s, self.ttft_slo_factor, self.tbt_slo_factor)

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbps * 1e9 / 8
