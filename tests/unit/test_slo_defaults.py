"""Defaults that serve (issue 48), in the Conductor core without servers: SLOs relative to the deployment's unloaded
speed when none is set, no refusal for TBT at an idle decode instance, a probe now and then for an idle prefill
instance its prediction refuses, and a model timed on a busy machine taken for a guess."""

from __future__ import annotations

import math

import msgspec
import pytest

from factories import decode_report, prefill_report, schedule_request
from kvcentric.core.costmodel import CostModel
from kvcentric.core.protocol import MeasuredCost, Placement, Rejection
from kvcentric.core.scheduling.conductor import Conductor
from kvcentric.core.scheduling.config import SchedulerConfig
from kvcentric.core.scheduling.slo import TBT_FLOOR_S, TTFT_FLOOR_S, Slo, SloPolicy, summary

PRIOR = CostModel((0.001, 1e-3, 0.0, 0.0), (10.0, 0.0, 0.0), 1000, "roofline:terrible")
"""A roofline guess: it only ranks."""
SLOW_PREFILL = MeasuredCost(prefill=[0.0, 1e-3, 0.0, 0.0], prefill_samples=12, model="m", device="cpu")
"""1 ms per prompt token: 1 s for 1000 tokens, unloaded."""
SLOW_DECODE = MeasuredCost(decode=[0.2, 0.0, 0.0], decode_samples=12, model="m", device="cpu")
"""A decode step of 200 ms whatever the batch: twice the 100 ms SLO that fits `small` only."""


def cluster(prefill: MeasuredCost | None = SLOW_PREFILL, decode: MeasuredCost | None = SLOW_DECODE,
            running: int = 0, **settings) -> Conductor:
    settings.setdefault("block_size", 100)
    settings.setdefault("expect_cache", False)
    settings.setdefault("ttft_correction", False)
    core = Conductor(SchedulerConfig(**settings), PRIOR, stale_after_s=1.0, prior_trusted=False)
    core.observe(msgspec.structs.replace(prefill_report("p0"), cost=prefill), 0.0)
    core.observe(msgspec.structs.replace(decode_report("d0", running=running), cost=decode), 0.0)
    return core


def place(core: Conductor, request_id: str = "r", n_tokens: int = 1000, now: float = 0.1):
    return core.schedule(schedule_request(n_tokens, request_id), {}, now)


def test_relative_slos_are_the_papers_multiples_of_the_unloaded_times():
    slo = SloPolicy().for_request(1000, [CostModel((0.0, 1e-3, 0.0, 0.0), (0.2, 0.0, 0.0), 1)],
                                  [CostModel((0.0, 1e-3, 0.0, 0.0), (0.05, 0.0, 1e-5), 1)])
    assert slo == Slo(pytest.approx(10 * 1.0), pytest.approx(5 * (0.05 + 1e-5 * 1001)))
    assert SloPolicy(ttft_slo_s=4.0, tbt_slo_s=0.1).for_request(1000, [], []) == Slo(4.0, 0.1)
    assert SloPolicy().for_request(1000, [], []) == Slo(math.inf, math.inf)  # no trusted model: none known


def test_the_fastest_trusted_model_sets_the_relative_slo():
    fast, slow = (CostModel((0.0, per_token, 0.0, 0.0), (0.01, 0.0, 0.0), 1) for per_token in (1e-4, 1e-3))
    assert SloPolicy().ttft_s(5000, [slow, fast]) == pytest.approx(5.0)


def test_a_relative_slo_is_never_tighter_than_its_floor():
    """10x the prefill of a short prompt of a fast model is milliseconds, less than a request's hops: the floors
    (the absolute defaults of before) hold, and the multiples take over where they are larger."""
    fast = CostModel((0.0, 1e-5, 0.0, 0.0), (0.002, 0.0, 0.0), 1)
    assert SloPolicy().for_request(16, [fast], [fast]) == Slo(TTFT_FLOOR_S, TBT_FLOOR_S)
    slow = CostModel((0.0, 1e-3, 0.0, 0.0), (0.2, 0.0, 0.0), 1)
    assert SloPolicy().for_request(1000, [slow], [slow]) == Slo(pytest.approx(10.0), pytest.approx(1.0))
    assert SloPolicy(ttft_floor_s=0.0, tbt_floor_s=0.0).for_request(16, [fast], [fast]) == Slo(
        pytest.approx(10 * 16e-5), pytest.approx(0.01))


def test_a_slow_model_serves_a_lone_request_with_the_default_slos():
    core = cluster(ttft_slo_s=0.0, tbt_slo_s=0.0)
    decision = place(core)
    assert isinstance(decision, Placement), decision
    assert decision.ttft_slo_s == pytest.approx(10.0) and decision.tbt_slo_s == pytest.approx(1.0)


def test_relative_slos_still_refuse_a_burst_past_ten_unloaded_prefills():
    core = cluster(ttft_slo_s=0.0, tbt_slo_s=0.0, slo_headroom=0.1)
    decisions = [place(core, f"r{i}") for i in range(20)]
    admitted = [d for d in decisions if isinstance(d, Placement)]
    assert len(admitted) == 9  # the ninth waits 8 s and computes 1: 9 s = 0.9 x the 10 s SLO
    assert all(d.stage == "prefill" for d in decisions if isinstance(d, Rejection))


def test_an_idle_decode_instance_is_never_refused_for_tbt():
    for rejection in ("early", "predictive"):
        core = cluster(rejection=rejection, tbt_slo_s=0.1)  # 200 ms steps against an absolute 100 ms SLO
        assert isinstance(place(core), Placement), rejection
    busy = cluster(rejection="early", tbt_slo_s=0.1, running=1)
    decision = place(busy)
    assert isinstance(decision, Rejection) and decision.stage == "decode" and "100 ms SLO" in decision.message


def test_an_idle_prefill_instance_refused_on_its_prediction_for_a_while_gets_a_probe():
    core = cluster(ttft_slo_s=0.5, probe_every_s=5.0)  # 1 s predicted for 1000 tokens, over the 0.5 s SLO
    assert isinstance(place(core, "first"), Rejection)  # refused since 0.1 s
    for report in (prefill_report("p0"), decode_report("d0")):  # still alive 5 s on
        core.observe(report, 5.0)
    assert isinstance(place(core, "probe", now=5.2), Placement) and core.stats["probes"] == 1
    assert isinstance(place(core, "behind", now=5.3), Rejection)  # not idle any more: the probe is in flight
    core.forget("probe")
    assert isinstance(place(core, "soon", now=5.5), Rejection)  # idle again, refused again since now
    assert core.stats["probes"] == 1
    off = cluster(ttft_slo_s=0.5)  # probes are off unless asked for
    assert [isinstance(place(off, f"r{i}", now=0.1 + i / 10), Rejection) for i in range(5)] == [True] * 5


def test_a_model_timed_on_a_busy_machine_ranks_but_never_rejects():
    busy = msgspec.structs.replace(SLOW_PREFILL, guess=["prefill"])
    core = cluster(prefill=busy, ttft_slo_s=0.5)
    decision = place(core)
    assert isinstance(decision, Placement) and decision.predicted_ttft_s == pytest.approx(1.0)  # its own, unjudged
    assert core.models.source("p0", "prefill") == "busy" and not core.registry.prefill["p0"].trusted
    core.observe(msgspec.structs.replace(prefill_report("p0"), cost=SLOW_PREFILL), 0.2)  # measured again, quietly
    assert core.models.source("p0", "prefill") == "measured"
    assert isinstance(place(core, "again", now=0.3), Rejection)


def test_a_trusted_peer_stands_in_for_a_busy_guess():
    core = cluster(ttft_slo_s=0.5)
    busy = msgspec.structs.replace(SLOW_PREFILL, prefill=[0.0, 1e-2, 0.0, 0.0], guess=["prefill"])
    core.observe(msgspec.structs.replace(prefill_report("p1"), cost=busy), 0.0)
    assert core.models.source("p1", "prefill") == "peer" and core.registry.prefill["p1"].trusted


def test_the_slos_in_force_are_described_for_health_and_the_ready_line():
    core = cluster(ttft_slo_s=0.0, tbt_slo_s=0.0)
    view = core.slo_view(0.1)
    assert view["ttft"] == {"mode": "relative", "factor": 10.0, "prompt_tokens": 256, "s": pytest.approx(2.56)}
    assert view["tbt"]["mode"] == "relative" and view["tbt"]["s"] == pytest.approx(1.0)
    assert summary(view) == "TTFT 10x unloaded (~2.56 s for 256 tokens), TBT 5x unloaded (~1000 ms)"
    absolute = cluster(ttft_slo_s=4.0, tbt_slo_s=0.1).slo_view(0.1)
    assert summary(absolute) == "TTFT 4 s, TBT 100 ms"


def test_the_simulator_keeps_absolute_slos():
    from kvcentric.config import ConfigError
    from kvcentric.tools.sim import SimConfig
    with pytest.raises(ConfigError, match="--ttft-slo-s"):
        SimConfig(ttft_slo_s=0.0)
