"""The arithmetic of the conductor's long-term re-planning (PrfaaS §3.4.3) around `Replanner`: which
serving instances make up the PD cluster's prefill and decode pools, and, once a role switch shows in the
load reports, the threshold t that fits the new split over the lengths recently placed. It decides; it
sends no role switch and reads no clock.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from kvcentric.core.prfaas.planner import best_threshold
from kvcentric.core.prfaas.profile import PrfaasProfile
from kvcentric.core.prfaas.throughput import Counts, OperatingPoint
from kvcentric.core.prfaas.workload import LengthDistribution

if TYPE_CHECKING:
    from kvcentric.core.scheduling.clusters import ClusterRouter

RECENT_REQUESTS = 2000
"""Placed requests whose uncached and output lengths make the empirical workload of a t re-plan."""


def pd_pools(prefill: list, decode: list, router: ClusterRouter | None) -> tuple[list, list]:
    """The PD cluster's serving prefill and decode instances (all of them without a topology); a colocated
    instance, in both lists, belongs to neither pool."""
    if router is not None:
        prefill, decode = router.in_scope(prefill, router.pd), router.in_scope(decode, router.pd)
    colocated = {s.instance_id for s in prefill} & {s.instance_id for s in decode}
    return ([s for s in prefill if s.instance_id not in colocated],
            [s for s in decode if s.instance_id not in colocated])


def prfaas_instances(prefill: list, router: ClusterRouter | None) -> int | None:
    """How many of the prefill instances are in a PrfaaS cluster; None without a PrfaaS cluster."""
    if router is None or not router.prfaas:
        return None
    return sum(1 for s in prefill if s.cluster in router.prfaas)


class ThresholdRetuner:
    """Re-plans t with `planner.best_threshold` once the split a role switch asked for is in place, over
    the uncached and output lengths of the requests placed recently. Without a profile it re-plans nothing."""

    def __init__(self, profile: PrfaasProfile | None, recent: int = RECENT_REQUESTS) -> None:
        self.profile = profile
        self.lengths: collections.deque[tuple[int, int]] = collections.deque(maxlen=recent)
        """(uncached prompt tokens, max output tokens) of each recently placed request."""
        self.expected: tuple[int, int] | None = None
        """(N_p, N_d) a switch asked for; t is re-planned once the load reports show it."""

    def placed(self, uncached_tokens: int, output_tokens: int) -> None:
        self.lengths.append((uncached_tokens, output_tokens))

    def expect(self, n_prefill: int, n_decode: int) -> None:
        """A role switch was sent that should make the split N_p/N_d."""
        self.expected = (n_prefill, n_decode)

    def retune(self, n_prefill: int, n_decode: int, n_prfaas: int | None) -> OperatingPoint | None:
        """The operating point of the best t when the expected split has just shown (and there is a PrfaaS
        cluster, a profile and placed requests to judge by); else None. The expected split is forgotten once
        it shows."""
        if self.expected is None or (n_prefill, n_decode) != self.expected:
            return None
        self.expected = None
        if n_prfaas is None or self.profile is None or not self.lengths:
            return None
        return best_threshold(self.profile, self.workload(), Counts(n_prfaas, n_prefill, n_decode))

    def workload(self) -> LengthDistribution:
        """The recently placed requests as a length distribution (an uncached length of 0 counts as 1)."""
        uncached, outputs = zip(*self.lengths)
        return LengthDistribution.from_samples([max(1, n) for n in uncached], sum(outputs) / len(outputs),
                                               "recently placed requests")
