"""Long-term re-planning of PrfaaS §3.4.3: from the measured load of the PD cluster's prefill and decode
pools, which role change (prefill -> decode or decode -> prefill, how many instances) restores the balance
of equation (8); it decides, the conductor sends `kvc.control.<id>` (a `RoleSwitch`), the engine drains and
serves on in the other role (`kvcentric.engine.service.roles`). `Replanner` is the conductor's loop around it.

§3.4.3: "When Θ_prfaas + Θ_pd-p ≪ Θ_pd-d, prefill is the system bottleneck, and when ≫, decode is. The
scheduler identifies the binding constraint by monitoring queue depth and utilization at each stage" and
converts PD nodes between roles. Here each pool's *demand*, in instances' worth of work, is

    demand = utilization * instances + queued_s / window_s

(busy instances plus the backlog spread over the re-planning window: a queue means the pool needs more
than it has), and its *pressure* is demand / instances. The recommended split is the N_p of the same
N_p + N_d that minimises the larger pressure; a change is recommended only when the current pressures
differ by more than `imbalance` (hysteresis: §3.4.3 acts on persistent, not transient, imbalance) and
the move lowers the larger pressure, at most `max_step` instances at a time.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Literal

Action = Literal["none", "prefill_to_decode", "decode_to_prefill"]


@dataclasses.dataclass(frozen=True)
class PoolLoad:
    """One pool of the PD cluster over the last window."""

    instances: int
    utilization: float
    """Busy fraction, 0..1: prefill compute time / wall time; decode running sequences / BS_max slots."""
    queued_s: float = 0.0
    """Estimated seconds of work waiting in the pool's queues, all its instances together."""

    def __post_init__(self) -> None:
        if self.instances < 0 or not 0 <= self.utilization <= 1 or self.queued_s < 0:
            raise ValueError(f"need instances >= 0, 0 <= utilization <= 1, queued_s >= 0; got {self}")

    def demand(self, window_s: float) -> float:
        return self.utilization * self.instances + self.queued_s / window_s


@dataclasses.dataclass(frozen=True)
class ReplanPolicy:
    window_s: float = 300.0
    """Horizon over which a backlog should drain; the re-planning period."""
    imbalance: float = 1.25
    """Act only when one pool's pressure exceeds the other's by this factor."""
    max_step: int = 1
    """Instances converted per decision (a role change drains an instance first)."""
    min_prefill: int = 1
    min_decode: int = 1

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.imbalance < 1 or self.max_step < 1 or self.min_prefill < 0 \
                or self.min_decode < 1:
            raise ValueError(f"bad re-planning policy {self}")


@dataclasses.dataclass(frozen=True)
class RoleChange:
    action: Action
    count: int
    n_prefill: int
    """N_p after the change."""
    n_decode: int
    pressure_before: tuple[float, float]
    """(prefill, decode) demand per instance now."""
    pressure_after: tuple[float, float]
    reason: str


def _pressure(demand: float, instances: int) -> float:
    if instances == 0:
        return math.inf if demand > 0 else 0.0
    return demand / instances


def _worst(demand_p: float, demand_d: float, n_p: int, n_d: int) -> float:
    return max(_pressure(demand_p, n_p), _pressure(demand_d, n_d))


def best_split(demand_p: float, demand_d: float, total: int, policy: ReplanPolicy) -> int:
    """The N_p in [min_prefill, total - min_decode] minimising the larger pressure (ties: fewer N_p)."""
    low, high = policy.min_prefill, total - policy.min_decode
    if high < low:
        raise ValueError(f"{total} instances cannot hold {policy.min_prefill} prefill + {policy.min_decode} decode")
    return min(range(low, high + 1), key=lambda n_p: (round(_worst(demand_p, demand_d, n_p, total - n_p), 9), n_p))


def recommend_role_change(prefill: PoolLoad, decode: PoolLoad, policy: ReplanPolicy = ReplanPolicy()) -> RoleChange:
    """The role change §3.4.3 calls for, or action "none" with the reason."""
    n_p, n_d = prefill.instances, decode.instances
    demand_p, demand_d = prefill.demand(policy.window_s), decode.demand(policy.window_s)
    before = (_pressure(demand_p, n_p), _pressure(demand_d, n_d))
    target = best_split(demand_p, demand_d, n_p + n_d, policy)
    step = max(-policy.max_step, min(policy.max_step, target - n_p))
    after_p, after_d = n_p + step, n_d - step
    after = (_pressure(demand_p, after_p), _pressure(demand_d, after_d))
    high, low = max(before), min(before)
    if high == 0 or step == 0:
        return RoleChange("none", 0, n_p, n_d, before, before, _why_not(before, target, n_p))
    if low > 0 and high / low < policy.imbalance:
        return RoleChange("none", 0, n_p, n_d, before, before,
                          f"pressures {before[0]:.2f} (prefill) and {before[1]:.2f} (decode) are within "
                          f"{policy.imbalance:g}x of each other")
    if max(after) >= high:
        return RoleChange("none", 0, n_p, n_d, before, before, "no single move lowers the larger pressure")
    action: Action = "decode_to_prefill" if step > 0 else "prefill_to_decode"
    bottleneck = "prefill" if step > 0 else "decode"
    return RoleChange(action, abs(step), after_p, after_d, before, after,
                      f"{bottleneck} is the bottleneck (pressure {before[0]:.2f} prefill vs {before[1]:.2f} "
                      f"decode); the balanced split is N_p/N_d = {target}/{n_p + n_d - target}")


def _why_not(before: tuple[float, float], target: int, n_p: int) -> str:
    if max(before) == 0:
        return "both pools are idle"
    return f"the split is already the balanced one (N_p = {n_p})" if target == n_p else "no move allowed"


@dataclasses.dataclass(frozen=True)
class Sample:
    """One look at a pool: its instances' busy fractions and queued seconds, summed."""

    busy: float
    queued_s: float


@dataclasses.dataclass(frozen=True)
class Switch:
    """A decision of the live re-planner: which instances change role, and why."""

    change: RoleChange
    instance_ids: tuple[str, ...]
    to_role: Literal["prefill", "decode"]


class Replanner:
    """The conductor's long-term re-planning loop, pure (time passed in): average each pool's load over
    `policy.window_s`, ask `recommend_role_change` once at least half a window has been seen, and pick the
    least-loaded instances of the pool that gives. After a switch it waits a whole window (the drained
    instances come back in their new role and the averages must see the new split) before it judges again.
    """

    def __init__(self, policy: ReplanPolicy, bs_max: int, decode_time_s: float) -> None:
        if bs_max < 1 or decode_time_s <= 0:
            raise ValueError("bs_max must be >= 1 and decode_time_s > 0")
        self.policy, self.bs_max, self.decode_time_s = policy, bs_max, decode_time_s
        self.samples: collections.deque[tuple[float, Sample, Sample]] = collections.deque()
        self.quiet_until = 0.0
        self.last: RoleChange | None = None

    def observe(self, prefill: list, decode: list, now: float) -> None:
        """Registry states (`PrefillState`, `DecodeState`) of the PD cluster's serving instances."""
        p = Sample(sum(1.0 for s in prefill if s.queue_s(now) > 0 or s.pending_tokens > 0),
                   sum(s.queue_s(now) for s in prefill))
        # A decode backlog: requests with KV but no batch slot, each needing a slot for about t_d.
        d = Sample(sum(min(1.0, s.running / self.bs_max) for s in decode),
                   sum(s.waiting for s in decode) * self.decode_time_s / self.bs_max)
        self.samples.append((now, p, d))
        horizon = now - self.policy.window_s
        while self.samples and self.samples[0][0] < horizon:
            self.samples.popleft()

    def decide(self, prefill: list, decode: list, now: float) -> Switch | None:
        """A role change to make now, or None (too early, balanced, or nothing to move)."""
        if now < self.quiet_until or not self.samples or not prefill or not decode:
            return None
        if now - self.samples[0][0] < self.policy.window_s / 2:
            return None  # too little seen yet to call an imbalance persistent
        n = len(self.samples)
        loads = []
        prefill_samples = [p for _, p, _ in self.samples]
        decode_samples = [d for _, _, d in self.samples]
        for count, samples in ((len(prefill), prefill_samples), (len(decode), decode_samples)):
            busy = sum(sample.busy for sample in samples) / n
            queued = sum(sample.queued_s for sample in samples) / n
            loads.append(PoolLoad(count, min(1.0, busy / count), queued))
        change = recommend_role_change(loads[0], loads[1], self.policy)
        self.last = change
        if change.action == "none":
            return None
        to_role: Literal["prefill", "decode"]
        if change.action == "prefill_to_decode":
            donors = sorted(prefill, key=lambda s: (s.queue_s(now), s.instance_id))
            to_role = "decode"
        else:
            donors = sorted(decode, key=lambda s: (s.running, s.instance_id))
            to_role = "prefill"
        self.quiet_until = now + self.policy.window_s
        self.samples.clear()
        return Switch(change, tuple(s.instance_id for s in donors[:change.count]), to_role)
