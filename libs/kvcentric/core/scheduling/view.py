"""What a placement policy sees of one prefill candidate at one decision (`PrefillView`): built once per
`Conductor.schedule` call from the instance's last whole load report, the placements made there that its reports
do not show yet, its TTFT correction and the blocks of the prompt it holds. Pure, time passed in; a view is a
value that policies read and nothing writes through (the Conductor accounts a placement on its registry).

A pipelined prefill group's view is built in `groups` from its stages; this module builds a whole instance's, and
names an instance that only holds blocks to pull (`BlockHolder`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

from kvcentric.core.costmodel import CostModel
from kvcentric.core.protocol import LoadReport
from kvcentric.core.scheduling.registry import PrefillState


@dataclasses.dataclass(frozen=True, slots=True)
class PromptBlocks:
    """The leading blocks of one prompt each instance holds now (kvs-meta's answer, or the conductor's mirror of
    it) and those it is expected to hold once the prefills placed there are done (Mooncake §6.1)."""

    held: Mapping[str, int] = dataclasses.field(default_factory=dict)
    expected: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def prefix(self, instance_id: str, held: int) -> int:
        """The blocks an instance with `held` blocks now will have: the longer of those and its expected ones
        (every expectation is a whole prompt's chain from its first block, so the longer one is the prefix)."""
        return max(held, self.expected.get(instance_id, 0))


NO_PROMPT = PromptBlocks()
"""No prompt: views for status and routing statistics, where no instance holds anything of a request."""


class PrefillView(NamedTuple):
    """One prefill candidate (an instance, or a pipelined group named by its first stage) as of one decision:
    immutable, and a tuple because the Conductor builds one per candidate per decision (a frozen dataclass costs
    several times as much to build)."""

    instance_id: str
    kv_addr: str
    cluster: str
    report: LoadReport | None
    """Its last load report that carried load numbers, whole (a group's: its first stage's); None before one.
    Its numbers are as the instance sent them: `queue_s` and `load_tokens` add what was placed there since."""
    queue_s: float
    """T_queue: seconds before a request placed now would start its prefill there (its reported queue still to
    drain, plus the predicted seconds of the placements its reports do not show yet)."""
    load_tokens: int
    """Tokens still to prefill there (Llumnix's allPrefillsTokensNum): its reported ones plus those in flight."""
    in_flight: int
    """Placements made there that its reports do not show yet."""
    cost: CostModel | None
    """Its own measured cost model (a group's: its pipelined one); None: the estimator's prior predicts for it."""
    trusted: bool
    """Whether its predictions may reject a request (a measured model, or a prior from a profile)."""
    correction: float = 1.0
    """What its predicted TTFT is multiplied by to rank and judge it: the Conductor's learned correction
    (`correction.TtftCorrection.factor`), 1 without."""
    prefix_blocks: int = 0
    """Leading blocks of this request's prompt it holds or is expected to hold (0 below the cache-aware
    minimum): what it would not compute."""
    held_blocks: int = 0
    """Of those, the ones it holds now: the only ones another instance can pull from it."""
    pipeline_addrs: tuple[str, ...] = ()
    """A group's later stages' messengers, in order (a whole instance has none)."""


class BlockHolder(NamedTuple):
    """An instance that is no prefill candidate but holds leading blocks of the prompt a prefill instance may pull
    from its messenger: a decode instance keeping the KV a prefill killed mid-prompt had pushed it
    (`holders.pull_from_holder`)."""

    instance_id: str
    kv_addr: str
    cluster: str
    held_blocks: int


def instance_view(state: PrefillState, now: float, prompt: PromptBlocks = NO_PROMPT,
                  correction: float = 1.0) -> PrefillView:
    """The view of a whole prefill instance at `now`."""
    instance_id, in_flight = state.instance_id, state.in_flight
    held, expected = prompt.held.get(instance_id, 0), prompt.expected.get(instance_id, 0)
    return PrefillView(instance_id, state.kv_addr, state.cluster, state.report,
                       max(0.0, state.queue_end - now) + in_flight.seconds,  # PrefillState.queue_s, inlined
                       state.pending_tokens + in_flight.tokens, len(in_flight.placed), state.cost, state.trusted,
                       correction, held if held >= expected else expected, held)
