"""Decode instance selection and overload admission (Mooncake Algorithm 1 lines 24-27 and §7), chosen by
rejection mode; it judges a placement and returns a verdict, it changes no state.

Load is SLO satisfaction (§7.1): prefill load = predicted TTFT / TTFT_SLO of the chosen prefill
instance; decode load = predicted TBT / TBT_SLO. Modes:

- `never`: admit everything (no load rejection at all; the paper's vLLM baseline and §6.2's runs).
- `none`: each stage rejects on arrival, the paper's §8.2 baseline: here only the prefill stage's
  check (TTFT); the decode instance double-checks TBT itself when the KV arrives (§3 step 4).
- `early` (§7.2): before prefill, on the larger of prefill load and the chosen decode instance's load
  now (its batch as last reported, plus this request).
- `predictive` (§7.4): as early, but the decode load is predicted for the moment the request reaches
  decode (now + predicted TTFT), every request decoding for a uniform t_d, averaged over the decode
  pool ("the average TBT ratio of all decoding instances to l_tbt").

Decode room (Mooncake §3): a request fits a decode instance when its KV, with that of the requests already
placed there and still in prefill, fits the free blocks of the cache or, beyond them, its host staging (where
it waits for blocks, out of the batch). When it fits none, every mode but `never` rejects it before a prefill
is spent, whatever the loads.

An instance whose model is only a guess (no measurement, no profile, or a calibration timed while the machine was
busy) is never the reason for a rejection: its predictions still rank instances, but its load counts as 0
(`DecodeState.trusted`). Nor is a decode instance with nothing running: a lone request there decodes at the unloaded
speed, which is what a relative SLO is made of and what no refusal could improve (`predictive`: while every
instance of the pool is idle).

SLOs: the admission's own (absolute) unless a verdict is given a request's `Slo` (`slo.SloPolicy`: relative to
the deployment's unloaded speed when the operator set none).

Bursts (`bursts`): while the prefill work offered lately is a burst the pool clears within `burst_s`, a request's
predicted TTFT is judged against the longer of its SLO and `burst_s` (it is queued); under sustained overload, against
its SLO alone.

Priorities: a request of priority p is admitted while load <= 1 - priority_step * (top_priority - p)
(never below 0.05), so under overload lower classes are rejected first; priorities at or above
`top_priority` are held to the SLO itself.

Headroom (`slo_headroom` h): every threshold is multiplied by 1 - h, so a request is admitted only while its
predicted load leaves that share of the SLO spare. A prediction is a forecast of a queue that the admitted
load itself slows (on shared hardware each admitted request later decodes beside the prefills behind it), so
predictions run short just as the load peaks; the headroom is what the admission keeps for that error.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, get_args

from kvcentric.core.protocol import ScheduleRequest
from kvcentric.core.scheduling.estimators import Estimator
from kvcentric.core.scheduling.registry import DecodeState
from kvcentric.core.scheduling.slo import Slo

RejectionMode = Literal["never", "none", "early", "predictive"]
"""The overload rejection modes (the module docstring says what each does), by the name `--rejection` takes."""
REJECTION_MODES: tuple[str, ...] = get_args(RejectionMode)
MAX_RATIO = 10.0
"""A decode instance that cannot fit the request counts as this many times its TBT SLO in pool averages."""


@dataclasses.dataclass(slots=True)
class DecodeChoice:
    instance: DecodeState
    tbt_s: float
    """Predicted TBT on it: now (never/none/early) or when the request arrives (predictive)."""
    load: float
    """Decode load that admission judges (0 where the mode does not look at decode)."""
    room: bool = True
    """Whether the request's KV fits the instance, its cache or its host staging."""


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    stage: str
    """"prefill" or "decode": whose load was too high."""
    load: float
    threshold: float
    message: str
    retry_after_s: float


class Admission:
    def __init__(self, mode: str, estimator: Estimator, ttft_slo_s: float, tbt_slo_s: float,
                 priority_step: float = 0.2, top_priority: int = 0, slo_headroom: float = 0.0) -> None:
        if mode not in REJECTION_MODES:
            raise ValueError(f"unknown rejection mode {mode!r}; choose {', '.join(REJECTION_MODES)}")
        if ttft_slo_s < 0 or tbt_slo_s < 0:
            raise ValueError("SLOs must be positive (or 0: given with each request)")
        if not 0 <= slo_headroom < 1:
            raise ValueError("slo_headroom must be in [0, 1)")
        self.mode, self.estimator = mode, estimator
        self.ttft_slo_s, self.tbt_slo_s = ttft_slo_s, tbt_slo_s
        self.slo = Slo(ttft_slo_s or math.inf, tbt_slo_s or math.inf)
        """The SLOs a request is held to when no `Slo` of its own is given (inf: none)."""
        self.priority_step, self.top_priority, self.slo_headroom = priority_step, top_priority, slo_headroom

    def threshold(self, priority: int) -> float:
        by_priority = max(0.05, 1.0 - self.priority_step * max(0, self.top_priority - priority))
        return by_priority * (1.0 - self.slo_headroom)

    # ---------------------------------------------------------------- decode choice

    def choose_decode(self, request: ScheduleRequest, decodes: list[DecodeState], arrival: float, now: float,
                      t_d: float, slo: Slo | None = None) -> DecodeChoice:
        """SelectDecodingInstance: least predicted TBT. Outside `predictive`, requests placed there but
        still in prefill count for the choice (so a burst spreads out) but not for the load judged."""
        if self.mode == "predictive":
            return self._choose_predicted(request, decodes, arrival, t_d, (slo or self.slo).tbt_s)
        prior = self.estimator.cost.decode
        n = request.n_tokens
        best, best_tbt = decodes[0], math.inf
        for instance in decodes:  # hot loop, kept flat: t_decode of its batch plus what is in flight
            d0, d1, d2 = instance.cost.decode if instance.cost is not None else prior
            forecast = instance.forecast
            batch, tokens = instance.running + 1, instance.kv_tokens + n
            if forecast.starts and forecast.starts[-1] > now:
                flying, flying_tokens = forecast.in_flight(now)
                batch, tokens = batch + flying, tokens + flying_tokens
            if tokens > instance.capacity_tokens + instance.staging_tokens:
                continue
            tbt = d0 + d1 * batch + d2 * tokens
            if tbt < best_tbt:
                best, best_tbt = instance, tbt
        return self.judge_current(request, best, now, slo)

    def judge_current(self, request: ScheduleRequest, instance: DecodeState, now: float,
                      slo: Slo | None = None) -> DecodeChoice:
        """The decode load of `instance` now, with this request added (0 where its model is only a guess, or where
        nothing runs there).
        Its room counts the KV of the requests placed there still in prefill too; a request that would wait
        in host staging does not join the batch judged."""
        tokens = instance.kv_tokens + request.n_tokens
        flying = instance.forecast.in_flight(now)[1] if instance.forecast.starts else 0
        if tokens + flying > instance.capacity_tokens + instance.staging_tokens:
            return DecodeChoice(instance, math.inf, 0.0, room=False)
        staged = tokens > instance.capacity_tokens
        batch, tokens = (instance.running, instance.kv_tokens) if staged else (instance.running + 1, tokens)
        tbt = self.estimator.tbt(batch, tokens, instance.capacity_tokens, instance.cost)
        judged = self.mode == "early" and instance.trusted and not instance.idle
        return DecodeChoice(instance, tbt, tbt / (slo or self.slo).tbt_s if judged else 0.0)

    def _choose_predicted(self, request, decodes, arrival, t_d, slo: float) -> DecodeChoice:
        prior = self.estimator.cost.decode
        n, limit = request.n_tokens, MAX_RATIO * slo
        best, best_tbt, total, judged, busy = decodes[0], math.inf, 0.0, 0, False
        for instance in decodes:  # hot loop, kept flat
            d0, d1, d2 = instance.cost.decode if instance.cost is not None else prior
            batch, tokens = instance.forecast.at(arrival, t_d)
            tokens += n
            room = instance.capacity_tokens + instance.staging_tokens  # what it reports and what will arrive
            fits = tokens <= room and instance.kv_tokens + n <= room
            tbt = d0 + d1 * (batch + 1) + d2 * min(tokens, instance.capacity_tokens) if fits else math.inf
            busy = busy or batch > 0 or not instance.idle
            if instance.trusted:  # the pool's load averages the instances whose model is more than a guess
                total += tbt if tbt < limit else limit
                judged += 1
            if tbt < best_tbt:
                best, best_tbt = instance, tbt
        load = total / slo / judged if judged and busy else 0.0
        return DecodeChoice(best, best_tbt, load, room=math.isfinite(best_tbt))

    def judge_predicted(self, request, instance: DecodeState, arrival: float, t_d: float,
                        slo: Slo | None = None) -> DecodeChoice:
        """Predictive load of one given decode instance (colocated placement has no choice)."""
        batch, tokens = instance.forecast.at(arrival, t_d)
        tbt = self.estimator.tbt(batch + 1, tokens + request.n_tokens, instance.capacity_tokens, instance.cost)
        judged = instance.trusted and (batch > 0 or not instance.idle)
        return DecodeChoice(instance, tbt, min(MAX_RATIO, tbt / (slo or self.slo).tbt_s) if judged else 0.0)

    # ---------------------------------------------------------------- admission

    def verdict(self, request: ScheduleRequest, ttft_s: float, decode: DecodeChoice, t_d: float,
                slo: Slo | None = None, burst_s: float = 0.0) -> Verdict | None:
        """None to admit; else why not. Algorithm 1 line 25: TTFT > TTFT_SLO or TBT > TBT_SLO (the decode load in
        `decode` was computed against the same `slo`). `burst_s`: while the offered load is a burst the pool clears
        (`bursts`), the TTFT a request may be queued for, when that is longer than its SLO."""
        if self.mode == "never":
            return None
        if not decode.room:
            return Verdict("decode", MAX_RATIO, 1.0, f"no decode instance has room for the KV of {request.n_tokens} "
                           "tokens (its cache or its host staging)", 1.0)
        slo = slo or self.slo
        threshold = self.threshold(request.priority)
        ttft_limit = max(slo.ttft_s, burst_s)
        prefill_load = ttft_s / ttft_limit
        decode_load = decode.load if self.mode in ("early", "predictive") else 0.0
        if max(prefill_load, decode_load) <= threshold:
            return None
        if prefill_load >= decode_load:
            excess = ttft_s - threshold * ttft_limit
            limit = (f"{ttft_limit:.3g} s a burst may queue for" if ttft_limit > slo.ttft_s else
                     f"{slo.ttft_s:.3g} s TTFT SLO")
            message = (f"predicted TTFT {ttft_s:.2f} s exceeds {threshold:.2f} x the {limit} "
                       f"(prefill load {prefill_load:.2f})")
            return Verdict("prefill", prefill_load, threshold, message, _clamp(excess))
        when = "when it would arrive" if self.mode == "predictive" else "now"
        message = (f"decode load {decode_load:.2f} {when} exceeds {threshold:.2f} (predicted TBT "
                   f"{decode.tbt_s * 1000:.1f} ms vs {slo.tbt_s * 1000:.4g} ms SLO)")
        return Verdict("decode", decode_load, threshold, message, _clamp(t_d * (1 - threshold / decode_load)))


def _clamp(seconds: float) -> float:
    return round(min(60.0, max(1.0, seconds)), 1)
