"""The short-term rules of PrfaaS §3.3 and §3.4.3 as pure functions: which cluster prefills a request (length
threshold on the uncached length, prefix caches judged per cluster or across clusters depending on the
bandwidth) and when to move the threshold t; it decides, it does not dispatch (the conductor does).

Routing (§3.3): l = l_total − cached prefix; l > t → a PrfaaS cluster, l <= t → PD-P of the local PD
cluster. With cached prefixes l_pd (PD cluster) and l_prfaas (PrfaaS cluster), §3.4.3:

- bandwidth *scarce*: each cluster's prefix counts only there: PD-P if l_total − l_pd <= t, else PrfaaS
  (computing l_total − l_prfaas there); no cache moves between clusters.
- bandwidth *abundant*: compute is what is scarce, so the best prefix anywhere counts:
  l_prefix = max(l_prfaas, l_pd); PD-P if l_total − l_prefix <= t, else PrfaaS; when the cluster holding
  the longer prefix is not the one that computes, its missing part is transferred across clusters first.

A PrfaaS prefill ships to the PD cluster only the KV the PD cluster lacks (l_total − l_pd tokens): the
global KV manager knows PD already holds its own prefix (§3.3). With several PrfaaS clusters the one
holding the longest prefix is chosen (ties: the first listed).

Threshold (§3.4.3): the scheduler watches the PrfaaS egress utilization and queue; when either nears its
limit t rises (fewer, longer offloads: less KV per second), and when both have fallen back t returns
step by step to the planned value. As our addition, a long local PD-P queue with an idle link and PrfaaS
lowers t (offload more). With the planner's profile, a trigger re-derives t instead (`rederive_threshold`):
the throughput model searched again with the measured egress bandwidth as B_out, over the uncached lengths
of the requests placed lately and the instances alive now ("profiles current compute capacity and egress
bandwidth, then searches for the optimal threshold t based on the incremental prefill-length
distribution"); without a profile t moves by `ShortTermPolicy.step`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Literal

from kvcentric.core.prfaas.planner import best_threshold
from kvcentric.core.prfaas.profile import BYTES_PER_S_PER_GBPS, PrfaasProfile
from kvcentric.core.prfaas.throughput import Counts
from kvcentric.core.prfaas.workload import LengthDistribution


@dataclasses.dataclass(frozen=True)
class RouteDecision:
    target: Literal["pd", "prfaas"]
    cluster: str
    """The cluster whose prefill instances compute the request."""
    cached: int
    """Prefix tokens the computing cluster reuses (after any cross-cluster transfer)."""
    uncached: int
    """Tokens it computes: l_total − cached."""
    cache_source: str | None
    """Cluster the prefix comes from when it is not `cluster` (a cross-cluster cache transfer), else None."""
    transfer_tokens: int
    """Prefix tokens moved from `cache_source` to `cluster` before prefill."""
    kv_to_pd_tokens: int
    """Tokens of KV a PrfaaS prefill ships to the PD cluster (0 for local prefill: RDMA, not the link)."""
    reason: str


def route(total: int, prefixes: Mapping[str, int], pd_cluster: str, prfaas_clusters: Sequence[str],
          threshold: float, bandwidth_scarce: bool) -> RouteDecision:
    """Where a request of `total` tokens prefills, given each cluster's cached prefix length (see module)."""
    _check(total, prefixes, pd_cluster, prfaas_clusters)
    cached = {name: prefixes.get(name, 0) for name in (pd_cluster, *prfaas_clusters)}
    remote = max(prfaas_clusters, key=lambda name: cached[name]) if prfaas_clusters else None
    if bandwidth_scarce:
        local_len = total - cached[pd_cluster]
        if local_len <= threshold or remote is None:
            return _local(total, cached[pd_cluster], pd_cluster, None, 0, f"scarce bandwidth: l = {local_len} <= t")
        return _remote(total, cached[remote], remote, None, 0, cached[pd_cluster],
                       f"scarce bandwidth: l = {local_len} > t, prefix judged per cluster")
    best = max(cached, key=lambda name: (cached[name], name == pd_cluster))
    best_len = cached[best]
    if total - best_len <= threshold or remote is None:
        source = best if best != pd_cluster and best_len > cached[pd_cluster] else None
        moved = best_len - cached[pd_cluster] if source else 0
        return _local(total, cached[pd_cluster] + moved, pd_cluster, source, moved,
                      f"ample bandwidth: l = {total - best_len} <= t with the best prefix ({best})")
    computing = best if best in prfaas_clusters else remote
    source = best if best != computing and best_len > cached[computing] else None
    moved = best_len - cached[computing] if source else 0
    return _remote(total, cached[computing] + moved, computing, source, moved, cached[pd_cluster],
                   f"ample bandwidth: l = {total - best_len} > t with the best prefix ({best})")


def _local(total: int, cached: int, cluster: str, source: str | None, moved: int, reason: str) -> RouteDecision:
    return RouteDecision("pd", cluster, cached, total - cached, source, moved, 0, reason)


def _remote(total: int, cached: int, cluster: str, source: str | None, moved: int, pd_cached: int,
            reason: str) -> RouteDecision:
    return RouteDecision("prfaas", cluster, cached, total - cached, source, moved, total - pd_cached, reason)


def _check(total: int, prefixes: Mapping[str, int], pd_cluster: str, prfaas_clusters: Sequence[str]) -> None:
    if total < 1:
        raise ValueError(f"a request has at least one token, got {total}")
    known = {pd_cluster, *prfaas_clusters}
    for name, length in prefixes.items():
        if name not in known:
            raise ValueError(f"prefix for unknown cluster {name!r}; clusters: {sorted(known)}")
        if not 0 <= length <= total:
            raise ValueError(f"cached prefix of {name!r} must be within 0..{total}, got {length}")


@dataclasses.dataclass(frozen=True)
class ShortTermPolicy:
    scarce_above: float = 0.7
    """Egress utilization above which bandwidth counts as scarce for `route`."""
    egress_high: float = 0.8
    egress_low: float = 0.5
    queue_high_s: float = 10.0
    """PrfaaS queue (estimated seconds of waiting prefill per instance) at which t rises."""
    queue_low_s: float = 2.0
    local_queue_high_s: float = 10.0
    """PD-P queue (seconds per instance) at which t falls, if the link and PrfaaS have room."""
    step: float = 1.25
    """Factor by which t moves per adjustment."""
    min_threshold: float = 0.0
    max_threshold: float = math.inf

    def __post_init__(self) -> None:
        if not (0 <= self.egress_low <= self.egress_high and 0 <= self.queue_low_s <= self.queue_high_s
                and self.step > 1 and self.min_threshold <= self.max_threshold):
            raise ValueError(f"bad short-term policy {self}")


def bandwidth_is_scarce(egress_utilization: float, policy: ShortTermPolicy = ShortTermPolicy()) -> bool:
    return egress_utilization > policy.scarce_above


@dataclasses.dataclass(frozen=True)
class ThresholdChange:
    threshold: float
    changed: bool
    reason: str


def adjust_threshold(current: float, planned: float, egress_utilization: float, prfaas_queue_s: float,
                     local_queue_s: float = 0.0, policy: ShortTermPolicy = ShortTermPolicy()) -> ThresholdChange:
    """One short-term step of t from the measured egress utilization (0..1) and queues (see module)."""
    def to(value: float, reason: str) -> ThresholdChange:
        value = min(policy.max_threshold, max(policy.min_threshold, value))
        return ThresholdChange(value, value != current, reason)
    if egress_utilization >= policy.egress_high or prfaas_queue_s >= policy.queue_high_s:
        return to(max(current, 1.0) * policy.step, f"PrfaaS near its ceiling (egress {egress_utilization:.0%}, "
                                                   f"queue {prfaas_queue_s:.1f} s): raise t")
    calm = egress_utilization <= policy.egress_low and prfaas_queue_s <= policy.queue_low_s
    if calm and local_queue_s >= policy.local_queue_high_s:
        return to(current / policy.step, f"local prefill queue {local_queue_s:.1f} s with PrfaaS idle: lower t")
    if calm and current > planned:
        return to(max(planned, current / policy.step), "PrfaaS calm again: back toward the planned t")
    if calm and current < planned and local_queue_s < policy.local_queue_high_s:
        return to(min(planned, current * policy.step), "local prefill calm again: back toward the planned t")
    return ThresholdChange(current, False, "within limits: keep t")


def rederive_threshold(current: float, trigger: ThresholdChange, profile: PrfaasProfile,
                       lengths: Sequence[tuple[int, int]], counts: Counts, egress_bytes_per_s: float,
                       policy: ShortTermPolicy = ShortTermPolicy()) -> ThresholdChange:
    """§3.4.3's short-term re-search of t when `adjust_threshold` triggered a move: the model's best t
    with B_out = the measured egress (bytes/s) over `lengths`, (uncached tokens, output tokens) of recent
    requests. A trigger that only returns t toward the plan, or nothing to judge by, keeps the trigger."""
    if not trigger.changed or "planned" in trigger.reason or not lengths or egress_bytes_per_s <= 0:
        return trigger
    if min(counts.prfaas, counts.pd_prefill, counts.decode) < 1:
        return trigger
    uncached, outputs = zip(*lengths)
    workload = LengthDistribution.from_samples([max(1, n) for n in uncached], sum(outputs) / len(outputs),
                                               "recently placed requests")
    gbps = egress_bytes_per_s / BYTES_PER_S_PER_GBPS
    point = best_threshold(profile.with_egress(gbps), workload, counts)
    value = min(policy.max_threshold, max(policy.min_threshold, float(point.threshold)))
    return ThresholdChange(value, value != current, f"{trigger.reason.rsplit(':', 1)[0]}: t re-derived from the "
                                                    f"throughput model at measured B_out {gbps:.3g} Gbps")
