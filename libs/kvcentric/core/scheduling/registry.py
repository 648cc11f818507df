"""What the Conductor knows of the instances: their last load report, plus what it placed there since
(dispatch-time accounting, reconciled by the next report, as Llumnix's "instant and accurate load").

Pure: time is passed in. An instance is alive while its last report is younger than `stale_after_s` and
does not say it is draining (a role change under way: it finishes its work but takes no new). A colocated
instance (prefill and decode in one) appears in both roles under the same id.

Busy is not dead: an engine's reports come from a heartbeat thread that nothing it computes or sends waits
on; while its event loop is busy the heartbeat repeats the last load (`repeat`), which keeps the instance
alive and placeable without resetting what was placed there since (it stays ranked by that load). One whose
reports stop is dead after `stale_after_s`; one whose loop has computed no load for `stuck_after_s` (its
heartbeat alone still beats) is out of placement too.
"""

from __future__ import annotations

import dataclasses
import math

from kvcentric.core.costmodel import CostModel
from kvcentric.core.protocol import InstanceInfo, LoadReport
from kvcentric.core.scheduling.estimators import DecodeForecast, Estimator
from kvcentric.core.scheduling.models import InstanceModels
from kvcentric.core.scheduling.queueing import InFlight


@dataclasses.dataclass(slots=True)
class PrefillState:
    instance_id: str
    kv_addr: str
    seen_at: float
    cluster: str = ""
    queue_end: float = 0.0
    """When the work in its last report drains (when the report was computed + its queue seconds)."""
    pending_tokens: int = 0
    """Tokens still to prefill there, per its last report (uncached ones when it counts them)."""
    in_flight: InFlight = dataclasses.field(default_factory=InFlight)
    """Placed there, not yet in its reports (dispatch-time accounting)."""
    draining: bool = False
    seq: int = 0
    """The heartbeat tick of its last report (0: a sender without one)."""
    load_age_s: float = 0.0
    """How old the load numbers of its last report were when sent."""
    cost: CostModel | None = None
    """Its own measured cost model (None: the estimator's prior predicts for it)."""
    trusted: bool = True
    """Whether its predictions may reject a request (a measured model, or a prior from a profile)."""
    report: LoadReport | None = None
    """Its last report that carried load numbers, whole (what a placement policy may read of it beyond the
    fields above, `view.PrefillView.report`)."""

    def queue_s(self, now: float) -> float:
        """T_queue: seconds before a request placed now would start its prefill."""
        return max(0.0, self.queue_end - now) + self.in_flight.seconds

    @property
    def dispatched_s(self) -> float:
        """Predicted prefill seconds placed there that its reports do not show yet."""
        return self.in_flight.seconds

    @property
    def dispatched_tokens(self) -> int:
        """Uncached tokens placed there that its reports do not show yet."""
        return self.in_flight.tokens

    @property
    def load_tokens(self) -> int:
        """Tokens still to prefill there (Llumnix's allPrefillsTokensNum)."""
        return self.pending_tokens + self.dispatched_tokens


@dataclasses.dataclass(slots=True)
class DecodeState:
    instance_id: str
    kv_addr: str
    seen_at: float
    cluster: str = ""
    running: int = 0
    """Requests in its decode batch, per its last report."""
    waiting: int = 0
    """Requests there waiting for their KV or for room in the batch."""
    kv_tokens: int = 0
    """Context tokens those requests hold."""
    capacity_tokens: float = math.inf
    """Context tokens its KV cache can hold."""
    staging_tokens: float = 0.0
    """Tokens of KV its host staging can still take: room for requests beyond its cache, which wait there."""
    forecast: DecodeForecast = dataclasses.field(default_factory=DecodeForecast)
    draining: bool = False
    seq: int = 0
    load_age_s: float = 0.0
    cost: CostModel | None = None
    """Its own measured cost model (None: the estimator's prior predicts for it)."""
    trusted: bool = True
    """Whether its predictions may reject a request (a measured model, or a prior from a profile)."""

    @property
    def idle(self) -> bool:
        """Nothing decoding there nor waiting for a slot, per its last report: a request placed there alone
        decodes at the unloaded speed."""
        return self.running == 0 and self.waiting == 0


class InstanceRegistry:
    def __init__(self, estimator: Estimator, stale_after_s: float = 1.5, stuck_after_s: float = math.inf,
                 models: InstanceModels | None = None, queue_time: str = "reported") -> None:
        """`queue_time`: "reported" takes each prefill instance's own T_queue and keeps the placements its
        reports do not list yet; "tokens" guesses T_queue from raw queued tokens and forgets every placement
        at each report (the estimate before instances reported one)."""
        self.estimator = estimator
        self.queue_time = queue_time
        self.models = models or InstanceModels(estimator.cost)
        """Each instance's measured cost model, when it sent one."""
        self.stale_after_s = stale_after_s
        self.stuck_after_s = stuck_after_s
        self.prefill: dict[str, PrefillState] = {}
        self.decode: dict[str, DecodeState] = {}
        self.missed_beats = 0
        """Heartbeat ticks that never arrived (gaps in the reports' `seq`), over every instance."""
        self.repeats = 0
        """Reports that only said an instance lives (its loop was busy, or its load had not changed)."""

    def _heard(self, state: PrefillState | DecodeState, report: LoadReport, now: float) -> bool:
        """Note that the instance lives; True when the report carries new load numbers to take."""
        if report.seq and state.seq and report.seq > state.seq:
            self.missed_beats += report.seq - state.seq - 1
        state.seq, state.seen_at, state.load_age_s = report.seq, now, report.load_age_s
        if report.repeat:
            self.repeats += 1
            return False
        return True

    def _placeable(self, state: PrefillState | DecodeState, now: float) -> bool:
        return state.seen_at >= now - self.stale_after_s and not state.draining \
            and state.load_age_s <= self.stuck_after_s

    def observe(self, report: LoadReport, now: float) -> PrefillState | DecodeState:
        """Take a load report: it replaces what was estimated since the previous one (a `repeat` only
        says the instance lives)."""
        self.models.learn(report)
        cost, trusted = self.models.model_of(report.instance_id, report.role)
        own = cost if cost is not self.models.prior else None
        if report.role == "prefill":
            state = self.prefill.get(report.instance_id)
            if state is None:
                state = self.prefill[report.instance_id] = PrefillState(report.instance_id, report.kv_addr, now)
            if not self._heard(state, report, now):
                return state
            state.kv_addr, state.cluster, state.report = report.kv_addr, report.cluster, report
            state.draining, state.cost, state.trusted = report.draining, own, trusted
            self._take_queue(state, report, own, now)
            return state
        decoder = self.decode.get(report.instance_id)
        if decoder is None:
            decoder = self.decode[report.instance_id] = DecodeState(report.instance_id, report.kv_addr, now)
        if not self._heard(decoder, report, now):
            return decoder
        block = self.estimator.block_tokens
        decoder.kv_addr, decoder.cluster = report.kv_addr, report.cluster
        decoder.draining, decoder.cost, decoder.trusted = report.draining, own, trusted
        decoder.running, decoder.waiting = report.running, report.queued_requests
        decoder.kv_tokens = (report.kv_blocks_total - report.kv_blocks_free) * block
        decoder.capacity_tokens = report.kv_blocks_total * block if report.kv_blocks_total else math.inf
        decoder.staging_tokens = report.kv_staging_blocks_free * block
        return decoder

    def _take_queue(self, state: PrefillState, report: LoadReport, own: CostModel | None, now: float) -> None:
        """The queue a prefill report shows, from when it was computed; the placements it does not show stay."""
        if self.queue_time == "tokens":
            state.queue_end = now + self.estimator.report_queue_s(report, own, reported=False)
            state.pending_tokens = report.queued_tokens
            state.in_flight.reconcile(None, now)
            return
        computed_at = now - report.load_age_s
        state.queue_end = computed_at + self.estimator.report_queue_s(report, own)
        state.pending_tokens = report.queued_uncached_tokens if report.queued_uncached_tokens >= 0 \
            else report.queued_tokens
        listed = set(report.prefill_ids) if report.prefill_ids is not None else None
        state.in_flight.reconcile(listed, computed_at)

    def place(self, instance_id: str, request_id: str, prefill_s: float, uncached: int, now: float) -> None:
        """A request placed on the prefill instance: it counts in its T_queue until its reports list it."""
        self.prefill[instance_id].in_flight.add(request_id, prefill_s, uncached, now)

    def unplace(self, instance_id: str, request_id: str) -> None:
        """A request placed there is over (or will not run): it no longer counts in its T_queue."""
        state = self.prefill.get(instance_id)
        if state is not None:
            state.in_flight.discard(request_id)

    def alive_prefill(self, now: float) -> list[PrefillState]:
        return [s for s in self.prefill.values() if self._placeable(s, now)]

    def alive_decode(self, now: float) -> list[DecodeState]:
        return [s for s in self.decode.values() if self._placeable(s, now)]

    def alive(self, role: str, now: float) -> list[PrefillState] | list[DecodeState]:
        return self.alive_prefill(now) if role == "prefill" else self.alive_decode(now)

    def serving_decode(self, instance_id: str, now: float) -> DecodeState | None:
        """The instance's decode side if it is alive and not draining (a colocated instance has one)."""
        state = self.decode.get(instance_id)
        return state if state is not None and self._placeable(state, now) else None

    def forget_stale(self, now: float, after_s: float = 60.0) -> None:
        for states in (self.prefill, self.decode):
            for instance_id in [k for k, s in states.items() if now - s.seen_at > after_s]:
                del states[instance_id]
                if instance_id not in self.prefill and instance_id not in self.decode:
                    self.models.forget(instance_id)

    def snapshot(self, now: float) -> list[InstanceInfo]:
        """Alive instances; load is queued prefill seconds, or the decode batch size."""
        prefill = [InstanceInfo(instance_id=s.instance_id, role="prefill", cluster=s.cluster, kv_addr=s.kv_addr,
                                load=round(s.queue_s(now), 4), age_s=round(now - s.seen_at, 3),
                                busy_s=round(s.load_age_s, 3))
                   for s in self.alive_prefill(now)]
        decode = [InstanceInfo(instance_id=s.instance_id, role="decode", cluster=s.cluster, kv_addr=s.kv_addr,
                               load=float(s.running), age_s=round(now - s.seen_at, 3),
                               busy_s=round(s.load_age_s, 3))
                  for s in self.alive_decode(now)]
        return prefill + decode
