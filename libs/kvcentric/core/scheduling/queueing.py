"""Prefill queue arithmetic: T_queue as the sum of the queued prefills' predicted times, queued load in
uncached tokens, and the placements an instance's load reports do not show yet. Pure: time is passed in;
it estimates and keeps accounts, it places and rejects nothing.

Mooncake §6.1: "The queuing time for a request is calculated by aggregating the prefill times of all queued
requests", each predicted from its length and prefix hit; the Conductor "updates the cache and queue times
for that instance" when it assigns a request. Llumnix ("Instant and Accurate Load"): prefill load is counted
in uncomputed tokens (numTokens - prefixHitNumTokens), and what was dispatched but is not yet in the
instance's report is added to it until a report shows it (dispatch-time account with reconciliation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable

from kvcentric.core.costmodel import CostModel

IN_FLIGHT_GRACE_S = 2.0
"""A placement that no load report computed this long after it lists is taken as seen (it was prefilled
between two reports, or refused); until then it counts on top of the reported queue."""


@dataclasses.dataclass(frozen=True, slots=True)
class QueuedPrefill:
    """One prompt waiting for, or in, prefill on an instance."""

    request_id: str
    tokens: int
    """Prompt tokens."""
    done: int
    """Leading tokens whose KV is there already: the cached prefix (expected, while queued), plus the chunks
    computed so far."""

    @property
    def uncached(self) -> int:
        return max(0, self.tokens - self.done)


def prefill_seconds(cost: CostModel, prefill: QueuedPrefill) -> float:
    """EstimatePrefillExecutionTime of what is left of one prompt: its uncached tokens over its done ones."""
    return cost.t_prefill(prefill.uncached, prefill.done) if prefill.uncached else 0.0


def queue_seconds(cost: CostModel, prefills: Iterable[QueuedPrefill]) -> float:
    """EstimatePrefillQueueTime (Mooncake §6.1): the sum of the predicted times of every queued prefill."""
    return sum(prefill_seconds(cost, prefill) for prefill in prefills)


def uncached_tokens(prefills: Iterable[QueuedPrefill]) -> int:
    """Llumnix's allPrefillsTokensNum counted in uncomputed tokens: what is still to compute."""
    return sum(prefill.uncached for prefill in prefills)


@dataclasses.dataclass(slots=True)
class InFlight:
    """Placements on one instance that its load reports do not show yet: their predicted prefill seconds and
    uncached tokens count on top of what the instance reports, until a report lists them (or, when its sender
    lists nothing, until any report: the behaviour of a sender that only sends totals)."""

    placed: dict[str, tuple[float, int, float]] = dataclasses.field(default_factory=dict)
    """request id -> (predicted prefill seconds, uncached tokens, when placed)."""
    seconds: float = 0.0
    tokens: int = 0

    def __len__(self) -> int:
        return len(self.placed)

    def add(self, request_id: str, prefill_s: float, uncached: int, now: float) -> None:
        self.discard(request_id)
        self.placed[request_id] = (prefill_s, uncached, now)
        self.seconds += prefill_s
        self.tokens += uncached

    def discard(self, request_id: str) -> None:
        entry = self.placed.pop(request_id, None)
        if entry is not None:
            self.seconds -= entry[0]
            self.tokens -= entry[1]
        if not self.placed:
            self.seconds, self.tokens = 0.0, 0

    def reconcile(self, listed: Collection[str] | None, computed_at: float, grace_s: float = IN_FLIGHT_GRACE_S) -> int:
        """A load report computed at `computed_at` listing the prompts queued or running there (`listed`; None:
        its sender lists none, so the report covers every placement). Keeps the placements it does not show
        and that were made less than `grace_s` before it; returns how many it dropped."""
        if listed is None:
            dropped = len(self.placed)
            self.placed.clear()
            self.seconds, self.tokens = 0.0, 0
            return dropped
        gone = [rid for rid, (_, _, at) in self.placed.items() if rid in listed or at <= computed_at - grace_s]
        for request_id in gone:
            self.discard(request_id)
        return len(gone)
