"""Predicted TTFT corrected from what came, per prefill instance: an exponentially weighted ratio of actual to
predicted TTFT, clamped to a sane range, raised to the ratio its latest prefill chunks ran at and to what the
placements that are late already show. Pure: time is passed in; it corrects a prediction, it admits and
rejects nothing.

Mooncake §7 rejects on predicted load; a prediction that is consistently short (a machine slower than its
fitted model, a queue that runs behind its estimate) admits requests that then miss the SLO. Each first token
teaches the ratio actual / predicted of its prefill instance (`learn`); until first tokens come, the
placements still waiting for theirs bound it from below (`overdue_ratio`: one placed 6 s ago with a predicted
TTFT of 2 s has a ratio of at least 3), so the correction grows from the first late request of a step of load
instead of one TTFT later. Sooner still, each prefill chunk an instance times (in its load reports) against its
own model says how much slower than its model it runs now (`learn_chunk`: a machine shared with other work),
which stretches its queue and its prefill alike.

Every ratio is measured against the instance's cost model, which the instance refits as it serves. A refit can
move its predictions by half at once (a window of chunks timed under load against one timed alone), and a ratio
learned against the old model then corrects the new one wrongly: predictions fell from 7.2 to 4.3 s for the same
queue in one live run, the instance looked the least loaded, and the next 19 requests went to it and missed. So
when an instance's model changes, what it learned is carried over to the new model (`rebase`): a ratio of f
against a model that predicted t for the instance's latest chunk becomes f x t / t' against one predicting t'.
Where nothing was learned yet the new model is trusted as the old one was. The first tokens of requests placed
before the change, and the waits of those still queued, are carried over the same way (`basis`), or their
old-model ratios would pull the factor back within a few outcomes.

The learned ratio is a mean; a request admitted at a corrected prediction just under the SLO misses it whenever
its own ratio lands above that mean. So, as TCP sets its retransmission timeout from the smoothed round trip
plus a multiple of its mean deviation (Jacobson, 1988; RFC 6298), the learned part of the factor is the
weighted mean ratio plus `spread` times the weighted mean absolute deviation of the ratios from it; so is the
chunk part (a queue's wait is the sum of many chunks: where they scatter, admission keeps a margin of that).
"""

from __future__ import annotations

import dataclasses
import itertools

WEIGHT = 0.25
"""How much one observed ratio moves the factor (an exponentially weighted mean of about 4 observations)."""
LOW, HIGH = 0.5, 4.0
"""The factor stays in [LOW, HIGH]: a prediction is never trusted to be more than 2x too long nor corrected by
more than 4x, whatever one outlier says."""
OLDEST_WAITING = 16
"""Placements still waiting for a first token looked at per instance (the oldest: the latest against their
predictions), so a decision costs the same however many are waiting."""
LEARNED_MEMORY = 10_000
"""Requests remembered as learned from (a request's first token and its end both carry its TTFT)."""


@dataclasses.dataclass(slots=True)
class Outstanding:
    placed_at: float
    predicted_s: float
    basis: float = 1.0
    """The instance's `TtftCorrection.basis` when it was placed: the model its prediction came from."""


class TtftCorrection:
    def __init__(self, min_predicted_s: float, weight: float = WEIGHT, low: float = LOW, high: float = HIGH,
                 max_wait_s: float = float("inf"), spread: float = 0.0) -> None:
        """`min_predicted_s`: predictions below it count as it in a ratio (a 10 ms prediction missed by 100 ms
        is noise, not a 10x slower machine). `max_wait_s`: a placement waiting longer than this for its first
        token is taken as lost (its request ended without one) and bounds nothing. `spread`: how many mean
        deviations of the ratios the learned factor adds to their mean (0: the mean alone)."""
        if not 0 < weight <= 1 or not 0 < low <= 1 <= high or min_predicted_s <= 0 or spread < 0:
            raise ValueError("need 0 < weight <= 1, 0 < low <= 1 <= high, min_predicted_s > 0 and spread >= 0")
        self.min_predicted_s, self.weight, self.low, self.high = min_predicted_s, weight, low, high
        self.max_wait_s, self.spread = max_wait_s, spread
        self.factors: dict[str, float] = {}
        """instance id -> the weighted mean of its ratios actual / predicted TTFT."""
        self.deviations: dict[str, float] = {}
        """instance id -> the weighted mean absolute deviation of its ratios from that mean."""
        self.speeds: dict[str, float] = {}
        """instance id -> the ratio measured / predicted its recent prefill chunks ran at."""
        self.speed_deviations: dict[str, float] = {}
        """instance id -> the weighted mean absolute deviation of its chunk ratios from that."""
        self.chunks_seen: dict[str, int] = {}
        self.waiting: dict[str, dict[str, Outstanding]] = {}
        """instance id -> request id -> its placement, for placements whose first token has not come."""
        self.basis: dict[str, float] = {}
        """instance id -> the product of its rebase scales: a prediction made at basis b is worth b' / b of one
        made now, at b'."""
        self.learned: dict[str, None] = {}
        self.observations = 0

    def clamp(self, ratio: float) -> float:
        return min(self.high, max(self.low, ratio))

    def ratio(self, predicted_s: float, actual_s: float, scale: float = 1.0) -> float:
        """actual / predicted TTFT, the prediction floored at `min_predicted_s`, times `scale` (a prediction made
        against an older model, carried to the current one), clamped."""
        return self.clamp(actual_s / max(predicted_s, self.min_predicted_s) * scale)

    def learn(self, instance_id: str, request_id: str, predicted_s: float, actual_s: float) -> float | None:
        """A request's first token came `actual_s` after it arrived, predicted `predicted_s`; returns the
        instance's new factor (None: nothing learned, a prediction or TTFT unknown or already counted). A request
        this correction placed before a rebase has its ratio carried to the current model as the factor was."""
        placement = self.waiting.get(instance_id, {}).get(request_id)
        carried = self.basis.get(instance_id, 1.0) / placement.basis if placement is not None else 1.0
        self.placed_done(instance_id, request_id)
        if predicted_s <= 0 or actual_s <= 0 or request_id in self.learned:
            return None
        self.learned[request_id] = None
        if len(self.learned) > LEARNED_MEMORY:
            del self.learned[next(iter(self.learned))]
        self.observations += 1
        return self._observe(self.factors, self.deviations, instance_id, self.ratio(predicted_s, actual_s, carried))

    def learned_factor(self, instance_id: str) -> float:
        """The learned part of the factor: the mean ratio plus `spread` mean deviations, clamped."""
        return self._with_spread(self.factors, self.deviations, instance_id)

    def learn_chunk(self, instance_id: str, samples: int, predicted_s: float, measured_s: float) -> float | None:
        """The instance's latest timed prefill chunk, its `samples`-th, took `measured_s` where its model says
        `predicted_s`; returns its new chunk ratio (None: that chunk was counted already, or a time unknown)."""
        if samples <= self.chunks_seen.get(instance_id, 0) or predicted_s <= 0 or measured_s <= 0:
            return None
        self.chunks_seen[instance_id] = samples
        return self._observe(self.speeds, self.speed_deviations, instance_id, self.clamp(measured_s / predicted_s))

    def speed_factor(self, instance_id: str) -> float:
        """The chunk ratio with its spread: the mean plus `spread` mean deviations, clamped (as the learned part)."""
        return self._with_spread(self.speeds, self.speed_deviations, instance_id)

    def _observe(self, means: dict[str, float], deviations: dict[str, float], instance_id: str,
                 ratio: float) -> float:
        """One more ratio into an instance's weighted mean (from 1) and mean absolute deviation; the new mean."""
        old, deviation = means.get(instance_id, 1.0), deviations.get(instance_id, 0.0)
        deviations[instance_id] = deviation + self.weight * (abs(ratio - old) - deviation)
        new = means[instance_id] = self.clamp(old + self.weight * (ratio - old))
        return new

    def _with_spread(self, means: dict[str, float], deviations: dict[str, float], instance_id: str) -> float:
        return self.clamp(means.get(instance_id, 1.0) + self.spread * deviations.get(instance_id, 0.0))

    def rebase(self, instance_id: str, scale: float) -> None:
        """The instance's cost model changed: what the old one predicted in t seconds the new one predicts in
        t / `scale`. Its learned and chunk ratios (and their deviations), measured against the old model, are
        multiplied by `scale`, so a corrected prediction does not jump with the model."""
        if not scale > 0 or scale == 1.0:
            return
        self.basis[instance_id] = self.basis.get(instance_id, 1.0) * scale
        for means, deviations in ((self.factors, self.deviations), (self.speeds, self.speed_deviations)):
            if instance_id in means:
                means[instance_id] = self.clamp(means[instance_id] * scale)
                deviations[instance_id] = deviations.get(instance_id, 0.0) * scale

    def placed(self, instance_id: str, request_id: str, predicted_s: float, now: float) -> None:
        """A request placed on `instance_id` now waits for its first token."""
        if predicted_s > 0:
            self.waiting.setdefault(instance_id, {})[request_id] = Outstanding(now, predicted_s,
                                                                               self.basis.get(instance_id, 1.0))

    def placed_done(self, instance_id: str, request_id: str) -> None:
        """Its first token came, or it ended, or it will not run: it bounds nothing any more."""
        waiting = self.waiting.get(instance_id)
        if waiting is not None and waiting.pop(request_id, None) is not None and not waiting:
            del self.waiting[instance_id]

    def overdue_ratio(self, instance_id: str, now: float) -> float:
        """The least ratio the placements still waiting on `instance_id` are known to have: the largest of
        waited / predicted over the OLDEST_WAITING longest waiting (in a FIFO queue the later ones waited less for
        a longer prediction), LOW when none waits. Placements past `max_wait_s` are dropped as lost."""
        worst, lost, basis = self.low, [], self.basis.get(instance_id, 1.0)
        for request_id, placement in itertools.islice(self.waiting.get(instance_id, {}).items(), OLDEST_WAITING):
            waited = now - placement.placed_at
            if waited > self.max_wait_s:
                lost.append(request_id)
            else:
                worst = max(worst, waited / max(placement.predicted_s, self.min_predicted_s) * basis / placement.basis)
        for request_id in lost:
            self.placed_done(instance_id, request_id)
        return self.clamp(worst)

    def factor(self, instance_id: str, now: float) -> float:
        """What to multiply `instance_id`'s predicted TTFT by: its learned ratio, raised to the ratio its chunks
        run at and to what its late placements show already."""
        return max(self.learned_factor(instance_id), self.speed_factor(instance_id),
                   self.overdue_ratio(instance_id, now))

    def forget(self, instance_id: str) -> None:
        for table in (self.factors, self.deviations, self.speeds, self.speed_deviations, self.chunks_seen,
                      self.waiting, self.basis):
            table.pop(instance_id, None)
