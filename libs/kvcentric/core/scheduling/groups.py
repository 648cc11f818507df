"""Pipelined prefill groups as the Conductor sees them (Mooncake §5.1): the stages of a group, each reporting
as a prefill instance, become one prefill candidate, named by its first stage, with a pipelined T_prefill
(about the slowest stage's chunk time x (chunks + X - 1), `core.pipeline.pipelined_t_prefill`), the longest
prefix every stage holds, and the queue of its busiest stage. Algorithm 1 then runs unchanged over whole
instances and groups alike. Pure, time passed in; it places nothing itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from kvcentric.core.costmodel import CostModel
from kvcentric.core.pipeline import pipelined_t_prefill
from kvcentric.core.protocol import LoadReport
from kvcentric.core.scheduling.registry import PrefillState

DEFAULT_CHUNK = 512
"""The chunk assumed of a group whose stages' cost models do not say theirs."""


@dataclasses.dataclass(frozen=True)
class PipelinedCost(CostModel):
    """A group's cost: its stages' models (each for its own slice, `share` 1; or the whole model's, `share`
    1/X), pipelined over chunks of `chunk` tokens."""

    stage_costs: tuple[CostModel, ...] = ()
    share: float = 1.0
    chunk: int = DEFAULT_CHUNK

    def t_prefill(self, n_new: int, n_cached: int = 0) -> float:
        return pipelined_t_prefill(self.stage_costs, n_new, n_cached, self.chunk, self.share)


@dataclasses.dataclass(frozen=True)
class Membership:
    group: str
    stage: int
    stages: int


class PrefillGroups:
    """Which prefill instances are stages of which group, and each group's candidate state."""

    def __init__(self, prior: CostModel) -> None:
        self.prior = prior
        self.members: dict[str, Membership] = {}
        self.states: dict[str, PrefillState] = {}
        """Group name -> its candidate (persisted: what was placed on it accumulates like an instance's)."""
        self.addrs: dict[str, list[str]] = {}
        """Head instance id -> messengers of the later stages, in order (the job's pipeline_addrs)."""

    def observe(self, report: LoadReport) -> None:
        if report.role == "prefill" and report.pipeline_group and report.stages > 1:
            self.members[report.instance_id] = Membership(report.pipeline_group, report.stage, report.stages)

    def candidates(self, prefills: list[PrefillState], hits: Mapping[str, int],
                   now: float) -> tuple[list[PrefillState], Mapping[str, int]]:
        """Whole instances as they are, each group whose every stage is alive as one candidate (keyed by its
        first stage's id, with the prefix all its stages hold); the stages themselves are no candidates."""
        if not self.members:
            return prefills, hits
        whole = [s for s in prefills if s.instance_id not in self.members]
        stages: dict[str, list[PrefillState]] = {}
        for state in prefills:
            member = self.members.get(state.instance_id)
            if member is not None:
                stages.setdefault(member.group, []).append(state)
        merged_hits = dict(hits)
        for group, alive in stages.items():
            alive.sort(key=lambda s: self.members[s.instance_id].stage)
            if [self.members[s.instance_id].stage for s in alive] != list(range(self.members[alive[0].instance_id]
                                                                                .stages)):
                continue  # a stage is missing: the group cannot prefill
            state = self._refresh(group, alive)
            merged_hits[state.instance_id] = min(hits.get(s.instance_id, 0) for s in alive)
            whole.append(state)
        return whole, merged_hits

    def _refresh(self, group: str, alive: list[PrefillState]) -> PrefillState:
        head = alive[0]
        state = self.states.get(group)
        if state is None or state.instance_id != head.instance_id:
            state = self.states[group] = PrefillState(head.instance_id, head.kv_addr, head.seen_at)
        state.in_flight = head.in_flight  # one record: placements on the group count on its head's reports
        state.kv_addr, state.cluster, state.seen_at = head.kv_addr, head.cluster, min(s.seen_at for s in alive)
        state.queue_end = max(s.queue_end for s in alive)
        state.pending_tokens = head.pending_tokens
        state.trusted = all(s.trusted for s in alive)
        state.cost = self.group_cost(alive)
        self.addrs[head.instance_id] = [s.kv_addr for s in alive[1:]]
        return state

    def group_cost(self, alive: list[PrefillState]) -> PipelinedCost:
        """The stages' own measured models when every stage has one, else the prior's whole model split evenly."""
        own = [s.cost for s in alive]
        measured = all(c is not None for c in own)
        costs = tuple(c for c in own if c is not None) if measured else (self.prior,) * len(alive)
        base = costs[0]
        chunk = next((c.prefill_chunk for c in costs if c.prefill_chunk), DEFAULT_CHUNK)
        return PipelinedCost(base.prefill, base.decode, base.kv_bytes_per_token, f"pipeline:{len(alive)}",
                             base.kv_bytes_fixed, 0, stage_costs=costs,
                             share=1.0 if measured else 1.0 / len(alive), chunk=chunk)

    def later_stages(self, instance_id: str) -> list[str]:
        """The pipeline_addrs of a job placed on `instance_id` ([] for a whole instance)."""
        return list(self.addrs.get(instance_id, [])) if instance_id in self.members else []
