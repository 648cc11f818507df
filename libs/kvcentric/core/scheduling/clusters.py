"""The Conductor's Prefill-as-a-Service step (PrfaaS §3.3, §3.4.3): picks the cluster whose prefill pool
computes a request, from the uncached length, the threshold t and each cluster's cached prefix, and moves
t from the measured egress use and queues; it narrows the candidates, the placement policy picks the node.

Pure: time is passed in. The rules themselves are `kvcentric.core.prfaas.routing` (route, adjust_threshold);
this module feeds them what the conductor knows: the topology, the alive prefill instances by their
reported `cluster`, the prefix blocks each holds (kvs-meta), the bytes each PrfaaS instance's messenger has
pushed (`LoadReport.kv_bytes_sent`, for egress utilization) and the queues of both pools. It also predicts
the KV's crossing of the inter-cluster link into TTFT (layer-wise, so it overlaps the prefill) and keeps
a FIFO backlog of that link. Decode always happens in the local PD cluster (the conductor's own).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence

from kvcentric.core.costmodel import CostModel
from kvcentric.core.prfaas.profile import PrfaasProfile
from kvcentric.core.prfaas.routing import (RouteDecision, ShortTermPolicy, ThresholdChange, adjust_threshold,
                                      bandwidth_is_scarce, rederive_threshold, route)
from kvcentric.core.prfaas.throughput import Counts
from kvcentric.core.prfaas.topology import Topology
from kvcentric.core.protocol import LoadReport, ScheduleRequest
from kvcentric.core.scheduling.estimators import Estimator
from kvcentric.core.scheduling.policies import PlacementPolicy, PrefillChoice, best_holder
from kvcentric.core.scheduling.view import PrefillView


@dataclasses.dataclass(frozen=True)
class ClusterSetup:
    """What the conductor needs to route across clusters (from `--topology` and the `--prfaas-*` flags)."""

    topology: Topology
    local: str
    """The PD cluster this conductor serves: decode runs here, short prefills run here."""
    threshold: float
    """Planned t: uncached tokens above which a request prefills in a PrfaaS cluster (`kvcentric plan`)."""
    adjust_s: float = 1.0
    """Seconds between two short-term steps of t (0: t stays at the plan)."""
    short_term: ShortTermPolicy = ShortTermPolicy()
    costs: Mapping[str, CostModel] = dataclasses.field(default_factory=dict)
    """Cost model per cluster where its hardware differs from the conductor's default one."""
    egress_window_s: float = 5.0
    """Egress use is the bytes pushed over this many seconds of load reports."""
    profile: PrfaasProfile | None = None
    """The planner's profile: with it a short-term trigger re-derives t from the throughput model at the
    measured egress bandwidth (§3.4.3); without it t moves by `short_term.step`."""

    def __post_init__(self) -> None:
        names = [c.name for c in self.topology.of_role("pd")]
        if self.local not in names:
            raise ValueError(f"cluster {self.local!r} is not a pd cluster of the topology (pd clusters: "
                             f"{', '.join(names)})")
        if self.threshold < 0 or self.adjust_s < 0 or self.egress_window_s <= 0:
            raise ValueError("threshold and adjust_s must be >= 0, egress_window_s > 0")

    @property
    def prfaas(self) -> tuple[str, ...]:
        """PrfaaS clusters with a link to the local PD cluster (others cannot ship KV here)."""
        return tuple(c.name for c in self.topology.of_role("prfaas")
                     if self.topology.link_gbps(c.name, self.local) > 0)

    def link_bytes_per_s(self, a: str, b: str) -> float:
        """The link between two clusters, each way, in bytes/s."""
        return self.topology.link_gbps(a, b) * 1e9 / 8


RECENT_REQUESTS = 2000
"""Placed requests whose uncached and output lengths make the workload a short-term re-derivation of t uses."""


class EgressMeter:
    """Bytes/s each instance's messenger pushed, from the cumulative counter in its load reports."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.samples: dict[str, collections.deque[tuple[float, int]]] = {}

    def observe(self, instance_id: str, sent_bytes: int, now: float) -> None:
        samples = self.samples.setdefault(instance_id, collections.deque())
        if samples and sent_bytes < samples[-1][1]:
            samples.clear()  # the instance restarted: its counter began again
        samples.append((now, sent_bytes))
        self._trim(samples, now)

    def _trim(self, samples: collections.deque, now: float) -> None:
        """Keep the samples of the window plus the last one before it (the baseline)."""
        while len(samples) > 1 and samples[1][0] <= now - self.window_s:
            samples.popleft()

    def rate(self, instance_ids: list[str], now: float) -> float:
        """Bytes/s over the window up to `now`: an instance that stopped reporting sent nothing since."""
        total = 0.0
        for instance_id in instance_ids:
            samples = self.samples.get(instance_id)
            if not samples:
                continue
            self._trim(samples, now)
            if len(samples) > 1 and now > samples[0][0]:
                total += (samples[-1][1] - samples[0][1]) / (now - samples[0][0])
        return total


@dataclasses.dataclass(slots=True)
class ClusterRoute:
    decision: RouteDecision
    candidates: list[PrefillView]
    source: PrefillView | None
    """Instance of another cluster holding the longer prefix, for a cross-cluster cache transfer."""
    source_blocks: int
    fallback: bool = False
    """The routed cluster had no alive prefill instance, so the other one computes."""
    pd_holder: PrefillView | None = None
    """The PD-cluster instance holding the longest prefix (l_pd), if any."""


class ClusterRouter:
    def __init__(self, setup: ClusterSetup, estimator: Estimator,
                 make_policy: Callable[[Estimator], PlacementPolicy]) -> None:
        self.setup = setup
        self.pd, self.prfaas = setup.local, setup.prfaas
        self.threshold = setup.threshold
        self.estimators = {name: Estimator(setup.costs[name], estimator.block_tokens) if name in setup.costs
                           else estimator for name in (self.pd, *self.prfaas)}
        self.policies = {name: make_policy(est) for name, est in self.estimators.items()}
        self.egress = EgressMeter(setup.egress_window_s)
        self.busy_until: dict[tuple[str, str], float] = {}
        """When each direction of an inter-cluster link has sent what was placed on it (a FIFO backlog)."""
        self.last_adjust: float | None = None
        self.last_change = ThresholdChange(self.threshold, False, "planned t")
        self.stats: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=RECENT_REQUESTS)
        """(uncached tokens, max output tokens) of the requests placed lately: the workload t is re-derived for."""
        self.push_rates: dict[str, float] = {}
        """Each PrfaaS instance's best measured KV push rate to the PD cluster's messengers, bytes/s."""

    # ---------------------------------------------------------------- inputs

    def observe(self, report: LoadReport, now: float) -> None:
        if report.role == "prefill" and report.cluster in self.prfaas:
            self.egress.observe(report.instance_id, report.kv_bytes_sent, now)
            if report.link_bandwidth:
                self.push_rates[report.instance_id] = max(report.link_bandwidth.values())

    def measured_egress(self, cluster: str, prefills: Sequence[PrefillView]) -> float:
        """B_out of a PrfaaS cluster as measured, bytes/s: its alive instances' push rates added up, never
        more than the link (the topology's figure until any push was measured)."""
        link = self.setup.link_bytes_per_s(cluster, self.pd)
        rates = [self.push_rates[s.instance_id] for s in prefills if s.cluster == cluster and
                 s.instance_id in self.push_rates]
        return min(link, sum(rates)) if rates else link

    def in_scope(self, states: Sequence, cluster: str) -> list:
        return [s for s in states if s.cluster == cluster]

    def utilization(self, cluster: str, prefills: Sequence[PrefillView], now: float) -> float:
        """Measured egress of a PrfaaS cluster over its link's capacity (0..1, more when over-driven)."""
        ids = [s.instance_id for s in prefills if s.cluster == cluster]
        return self.egress.rate(ids, now) / self.setup.link_bytes_per_s(cluster, self.pd)

    # ---------------------------------------------------------------- short-term t (§3.4.3)

    def tick(self, prefills: Sequence[PrefillView], now: float, decodes: int = 0) -> ThresholdChange | None:
        """One step of t when `adjust_s` has passed since the last one (`decodes`: PD decode instances alive,
        for the model's re-derivation)."""
        if not self.setup.adjust_s or not self.prfaas:
            return None
        if self.last_adjust is not None and now - self.last_adjust < self.setup.adjust_s:
            return None
        self.last_adjust = now
        egress = max(self.utilization(name, prefills, now) for name in self.prfaas)
        remote_q = max(_mean_queue(self.in_scope(prefills, name)) for name in self.prfaas)
        change = adjust_threshold(self.threshold, self.setup.threshold, egress, remote_q,
                                  _mean_queue(self.in_scope(prefills, self.pd)), self.setup.short_term)
        if self.setup.profile is not None and change.changed:
            change = self._rederive(change, prefills, decodes)
        if change.changed:
            self.stats["threshold_changes"] += 1
        self.threshold, self.last_change = change.threshold, change
        return change

    def _rederive(self, trigger: ThresholdChange, prefills: Sequence[PrefillView], decodes: int) -> ThresholdChange:
        """§3.4.3: t searched again from the model, at the measured egress of the PrfaaS clusters."""
        assert self.setup.profile is not None
        n_prfaas = sum(1 for s in prefills if s.cluster in self.prfaas)
        counts = Counts(n_prfaas, len(self.in_scope(prefills, self.pd)), decodes)
        egress = sum(self.measured_egress(name, prefills) for name in self.prfaas)
        change = rederive_threshold(self.threshold, trigger, self.setup.profile, list(self.recent), counts, egress,
                                    self.setup.short_term)
        self.stats["threshold_rederived"] += change is not trigger
        return change

    def replan(self, threshold: float, reason: str) -> None:
        """Long-term: a new planned t (`planner.best_threshold` after a role change); the short-term steps
        now return toward it."""
        self.setup = dataclasses.replace(self.setup, threshold=float(threshold))
        self.threshold = float(threshold)
        self.last_change = ThresholdChange(self.threshold, True, reason)
        self.stats["threshold_replans"] += 1

    # ---------------------------------------------------------------- routing (§3.3, §3.4.3)

    def route(self, request: ScheduleRequest, prefills: Sequence[PrefillView], now: float) -> ClusterRoute | None:
        """The cluster and its candidate instances; None when no cluster of the topology has one alive."""
        pools = {name: self.in_scope(prefills, name) for name in (self.pd, *self.prfaas)}
        remote = [name for name in self.prfaas if pools[name]]
        if not pools[self.pd] and not remote:
            return None
        n = request.n_tokens
        holders = {name: best_holder(pool) for name, pool in pools.items()}
        prefixes = {name: self.estimators[name].cached_tokens(n, blocks) for name, (_, blocks) in holders.items()
                    if name == self.pd or name in remote}
        threshold = self.threshold if pools[self.pd] else -1.0  # no PD-P alive: everything goes remote
        scarce = bandwidth_is_scarce(max((self.utilization(r, prefills, now) for r in remote), default=0.0),
                                     self.setup.short_term)
        decision = route(n, prefixes, self.pd, remote, threshold, scarce)
        fallback = not pools[decision.cluster]
        source, blocks = holders.get(decision.cache_source, (None, 0)) if decision.cache_source else (None, 0)
        return ClusterRoute(decision, pools[decision.cluster], source, blocks, fallback, holders[self.pd][0])

    def choose(self, request: ScheduleRequest, prefills: Sequence[PrefillView], now: float) -> PrefillChoice | None:
        """Route, let the cluster's policy pick the node, then add any cross-cluster cache transfer and,
        for a PrfaaS prefill, the KV's crossing of the link to the PD cluster."""
        routed = self.route(request, prefills, now)
        if routed is None:
            return None
        cluster = routed.decision.cluster
        choice = self.policies[cluster].choose(request, routed.candidates, now)
        if routed.source is not None and routed.source_blocks > choice.prefix_blocks:
            choice = self._pull_across(request, choice, routed.source, routed.source_blocks, cluster, now)
        if routed.decision.target == "prfaas":
            self._prefix_at_decode(request, choice, routed)
            choice.ttft_s = self._crossing_ttft(request, choice, cluster, now)
        self.stats[f"routed_{routed.decision.target}"] += 1
        self.stats["route_fallbacks"] += routed.fallback
        return choice

    def _pull_across(self, request: ScheduleRequest, choice: PrefillChoice, source: PrefillView, blocks: int,
                     cluster: str, now: float) -> PrefillChoice:
        """Cross-cluster cache transfer (§3.4.3, ample bandwidth): the node pulls the longer prefix first."""
        estimator = self.estimators[cluster]
        prefill_s = estimator.t_prefill(request.n_tokens, blocks)
        nbytes = estimator.block_bytes(blocks - choice.local_blocks)
        transfer_s = self._sent(source.cluster, cluster, nbytes, now) - now
        queue_s = choice.instance.queue_s
        self.stats["cross_cluster_transfers"] += 1
        return PrefillChoice(choice.instance, transfer_s + queue_s + prefill_s, prefill_s, blocks, source,
                             choice.local_blocks)

    def _prefix_at_decode(self, request: ScheduleRequest, choice: PrefillChoice, routed: ClusterRoute) -> None:
        """PrfaaS §3.3: only the part of the prompt the PD cluster lacks crosses the link; the decode
        instance takes the PD cluster's cached prefix (l_pd tokens) from the instance holding it."""
        pd_cached = request.n_tokens - routed.decision.kv_to_pd_tokens
        if pd_cached > 0 and routed.pd_holder is not None:
            choice.decode_prefix_source, choice.decode_prefix_tokens = routed.pd_holder, pd_cached
            self.stats["kv_tokens_kept_local"] += pd_cached

    def kv_to_pd_tokens(self, request: ScheduleRequest, choice: PrefillChoice) -> int:
        """Tokens of KV a PrfaaS prefill ships to the PD cluster: the prompt less the prefix decode takes
        from its own cluster."""
        return request.n_tokens - (choice.decode_prefix_tokens if choice.decode_prefix_source else 0)

    def _crossing_ttft(self, request: ScheduleRequest, choice: PrefillChoice, cluster: str, now: float) -> float:
        """KV streams layer by layer while the prefill runs: decode has it all at the later of prefill end
        and the link having sent it (behind what is already queued on the link)."""
        start = now + choice.ttft_s - choice.prefill_s
        nbytes = self.estimators[cluster].cost.kv_bytes(self.kv_to_pd_tokens(request, choice))
        return max(choice.ttft_s, self._sent(cluster, self.pd, nbytes, start) - now)

    def _sent(self, source: str, target: str, nbytes: float, start: float) -> float:
        """When `nbytes` put on the source -> target link at `start` have crossed, behind its backlog."""
        free = self.busy_until.get((source, target), 0.0)
        return max(start, free) + nbytes / self.setup.link_bytes_per_s(source, target)

    def account(self, request: ScheduleRequest, choice: PrefillChoice, now: float) -> None:
        """A placement was made: a prefix pulled from another cluster, and a PrfaaS prefill's KV from when its
        prefill starts (after the queue the choice saw), queue on their link."""
        cluster = choice.instance.cluster
        source = choice.source
        cached = self.estimators[cluster].cached_tokens(request.n_tokens, choice.prefix_blocks)
        self.recent.append((request.n_tokens - cached, request.max_tokens))
        if source is not None and source.cluster != cluster:
            nbytes = self.estimators[cluster].block_bytes(choice.pull_blocks)
            self.busy_until[(source.cluster, cluster)] = self._sent(source.cluster, cluster, nbytes, now)
        if cluster in self.prfaas:
            nbytes = self.estimators[cluster].cost.kv_bytes(self.kv_to_pd_tokens(request, choice))
            start = now + choice.instance.queue_s
            self.busy_until[(cluster, self.pd)] = self._sent(cluster, self.pd, nbytes, start)
            self.stats["kv_bytes_routed_remote"] += nbytes

    def status(self, prefills: Sequence[PrefillView], now: float) -> dict:
        """For /health and /metrics: t, the plan, egress use and queues per PrfaaS cluster, route counts."""
        return {"threshold": self.threshold, "planned_threshold": self.setup.threshold,
                "last_change": self.last_change.reason, "local": self.pd,
                "egress_utilization": {n: round(self.utilization(n, prefills, now), 4) for n in self.prfaas},
                "prfaas_queue_s": {n: round(_mean_queue(self.in_scope(prefills, n)), 3) for n in self.prfaas},
                "routed": {k: v for k, v in self.stats.items()}}


def _mean_queue(pool: Sequence[PrefillView]) -> float:
    return sum(s.queue_s for s in pool) / len(pool) if pool else 0.0
