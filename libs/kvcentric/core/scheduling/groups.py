"""Pipelined prefill groups as the Conductor sees them (Mooncake §5.1): the stages of a group, each reporting
as a prefill instance, become one prefill candidate, named by its first stage, with a pipelined T_prefill
(about the slowest stage's chunk time x (chunks + X - 1), `core.pipeline.pipelined_t_prefill`), the longest
prefix every stage holds, and the queue of its busiest stage (a `view.PrefillView` like a whole instance's).
Algorithm 1 then runs unchanged over whole instances and groups alike. Pure, time passed in; it places nothing
itself.
"""

from __future__ import annotations

import dataclasses

from kvcentric.core.costmodel import CostModel
from kvcentric.core.pipeline import pipelined_t_prefill
from kvcentric.core.protocol import LoadReport
from kvcentric.core.scheduling.registry import PrefillState
from kvcentric.core.scheduling.view import NO_PROMPT, PrefillView, PromptBlocks

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
    """Which prefill instances are stages of which group; it splits the alive instances into whole ones and
    complete groups, and builds a group's view from its stages (it keeps no state of a group beyond that: what
    is placed on a group counts on its first stage's reports)."""

    def __init__(self, prior: CostModel) -> None:
        self.prior = prior
        self.members: dict[str, Membership] = {}

    def observe(self, report: LoadReport) -> None:
        if report.role == "prefill" and report.pipeline_group and report.stages > 1:
            self.members[report.instance_id] = Membership(report.pipeline_group, report.stage, report.stages)

    def split(self, prefills: list[PrefillState]) -> tuple[list[PrefillState], list[list[PrefillState]]]:
        """The whole instances among `prefills`, and each group whose every stage is among them, its stages in
        order (groups in the order their first alive stage comes); the stages of an incomplete group are
        neither."""
        if not self.members:
            return prefills, []
        whole = [s for s in prefills if s.instance_id not in self.members]
        stages: dict[str, list[PrefillState]] = {}
        for state in prefills:
            member = self.members.get(state.instance_id)
            if member is not None:
                stages.setdefault(member.group, []).append(state)
        complete = []
        for alive in stages.values():
            alive.sort(key=lambda s: self.members[s.instance_id].stage)
            if [self.members[s.instance_id].stage for s in alive] == list(range(self.members[alive[0].instance_id]
                                                                              .stages)):
                complete.append(alive)
        return whole, complete

    def view(self, stages: list[PrefillState], now: float, prompt: PromptBlocks = NO_PROMPT,
             correction: float = 1.0) -> PrefillView:
        """A complete group as one candidate, named by its first stage: the queue of its busiest stage, the
        prefix every stage holds, its first stage's placements in flight and report, its pipelined cost."""
        head = stages[0]
        queue = max(s.queue_end for s in stages) - now
        held = min(prompt.held.get(s.instance_id, 0) for s in stages)
        return PrefillView(head.instance_id, head.kv_addr, head.cluster, head.report,
                           max(0.0, queue) + head.in_flight.seconds, head.load_tokens, len(head.in_flight),
                           self.group_cost(stages), all(s.trusted for s in stages), correction,
                           prompt.prefix(head.instance_id, held), held, tuple(s.kv_addr for s in stages[1:]))

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
