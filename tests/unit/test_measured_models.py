"""The Conductor predicts each instance with the cost model it measured of itself (`LoadReport.cost`): a
roofline prior only ranks and never rejects, a profile prior (or --cost-source prior) may; the measured model
replaces either; TBT predictions are checked against outcomes; the simulator runs pools with their own models."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from factories import decode_report, prefill_report, schedule_request
from kvcentric.core.costmodel import CostModel
from kvcentric.core.protocol import MeasuredCost, Placement, Rejection, RequestOutcome
from kvcentric.core.scheduling.conductor import Conductor
from kvcentric.core.scheduling.config import SchedulerConfig
from kvcentric.core.scheduling.models import InstanceModels, as_measured, measured_model
from kvcentric.core.sim.cluster import ClusterSpec, Simulation
from kvcentric.core.sim.workload import SimRequest

TERRIBLE = CostModel((0.001, 1e-3, 0.0, 0.0), (10.0, 0.0, 0.0), 1000, "roofline:terrible")
"""Prefill 1 s per 1000 tokens; a decode step of 10 s (the TBT SLO is 0.1 s)."""
FAST_DECODE = MeasuredCost(decode=[0.005, 1e-4, 1e-6], decode_error=0.03, decode_samples=40,
                           last_decode=[4.0, 2000.0, 0.0065], model="tiny", device="cpu", dtype="float32", version=3)
FAST_PREFILL = MeasuredCost(prefill=[0.002, 2e-4, 0.0, 0.0], prefill_error=0.05, prefill_samples=12,
                            last_prefill=[256.0, 0.0, 0.055], prefill_chunk=512, model="tiny", device="cpu",
                            dtype="float32", version=1)


def conductor(prior_trusted: bool, use_measured: bool = True, **settings) -> Conductor:
    settings.setdefault("block_size", 100)
    return Conductor(SchedulerConfig(**settings), TERRIBLE, stale_after_s=1.0, prior_trusted=prior_trusted,
                     use_measured=use_measured)


def with_cost(report, cost: MeasuredCost):
    return msgspec.structs.replace(report, cost=cost)


def announce(core: Conductor, decode_cost: MeasuredCost | None = None, prefill_cost: MeasuredCost | None = None,
             now: float = 0.0, running: int = 0) -> None:
    """p0 and d0 report (d0 decoding `running` sequences: an idle one is never refused for TBT)."""
    core.observe(with_cost(prefill_report("p0"), prefill_cost) if prefill_cost else prefill_report("p0"), now)
    decode = decode_report("d0", running=running)
    core.observe(with_cost(decode, decode_cost) if decode_cost else decode, now)


def test_a_trusted_prior_rejects_on_its_guess():
    core = conductor(prior_trusted=True)
    announce(core, running=1)
    decision = core.schedule(schedule_request(100), {}, 0.1)
    assert isinstance(decision, Rejection) and decision.stage == "decode"


def test_an_untrusted_prior_ranks_but_never_rejects():
    for rejection in ("early", "predictive"):
        core = conductor(prior_trusted=False, rejection=rejection)
        announce(core)
        decision = core.schedule(schedule_request(100), {}, 0.1)
        assert isinstance(decision, Placement), (rejection, decision)
        assert decision.predicted_tbt_s == pytest.approx(10.0)  # still predicted with the prior
        assert core.stats["placed_unjudged"] == 1


def test_the_measured_model_replaces_even_a_trusted_prior():
    core = conductor(prior_trusted=True)
    announce(core, decode_cost=FAST_DECODE)
    decision = core.schedule(schedule_request(100), {}, 0.1)
    assert isinstance(decision, Placement)
    assert decision.predicted_tbt_s == pytest.approx(0.005 + 1e-4 + 1e-6 * 100)
    state = core.registry.decode["d0"]
    assert state.trusted and state.cost is not None and state.cost.source == "measured:tiny@cpu/float32"


def test_a_measured_model_that_predicts_overload_rejects():
    slow = msgspec.structs.replace(FAST_DECODE, decode=[1.0, 0.0, 0.0])
    core = conductor(prior_trusted=False)
    announce(core, decode_cost=slow, running=1)
    decision = core.schedule(schedule_request(100), {}, 0.1)
    assert isinstance(decision, Rejection) and "predicted TBT 1000.0 ms" in decision.message


def test_with_measurements_ignored_the_prior_stays():
    core = conductor(prior_trusted=True, use_measured=False)
    announce(core, decode_cost=FAST_DECODE, running=1)
    assert isinstance(core.schedule(schedule_request(100), {}, 0.1), Rejection)
    assert core.registry.decode["d0"].cost is None


def test_ttft_is_predicted_with_the_prefill_instance_own_chunked_model():
    core = conductor(prior_trusted=False)
    announce(core, decode_cost=FAST_DECODE, prefill_cost=FAST_PREFILL)
    decision = core.schedule(schedule_request(1200), {}, 0.1)
    chunks = 3 * 0.002 + 1200 * 2e-4  # 512 + 512 + 176 tokens, the fixed cost once per chunk
    assert isinstance(decision, Placement) and decision.predicted_ttft_s == pytest.approx(chunks)


def test_the_instance_whose_own_model_is_faster_gets_the_prompt():
    core = conductor(prior_trusted=False, policy="cache_aware")
    core.observe(prefill_report("p1"), 0.0)  # prior: 1 s per 1000 tokens
    announce(core, decode_cost=FAST_DECODE, prefill_cost=FAST_PREFILL)
    decision = core.schedule(schedule_request(1000), {}, 0.1)
    assert isinstance(decision, Placement) and decision.prefill_id == "p0"


def test_outcomes_check_the_tbt_prediction():
    core = conductor(prior_trusted=False)
    announce(core, decode_cost=FAST_DECODE)
    placed = core.schedule(schedule_request(100, "r1"), {}, 0.1)
    outcome = RequestOutcome(request_id="r1", prefill_id=placed.prefill_id, decode_id=placed.decode_id,
                             finish_reason="length", ttft_s=0.2, e2e_s=0.2 + 9 * 0.01, prompt_tokens=100,
                             completion_tokens=10)
    core.on_outcome(outcome, 1.0)
    assert core.stats["tbt_outcomes"] == 1
    predicted = placed.predicted_tbt_s
    assert core.stats["tbt_error_sum_s"] == pytest.approx(predicted - 0.01)
    assert core.stats["tbt_rel_error_sum"] == pytest.approx(abs(predicted - 0.01) / 0.01)


def test_the_health_view_compares_the_latest_timings_with_the_model_and_the_prior():
    models = InstanceModels(TERRIBLE, prior_trusted=False)
    models.learn(with_cost(decode_report("d0"), FAST_DECODE))
    view = models.view("d0", ["decode"])
    assert view["model_source"] == {"decode": "measured"} and view["fit_error"]["decode"] == 0.03
    step = view["decode_step"]
    assert step["shape"] == [4, 2000] and step["measured_s"] == 0.0065 and step["prior_s"] == 10.0
    assert step["predicted_s"] == pytest.approx(0.005 + 4e-4 + 2e-3)
    assert models.view("p9", ["prefill"]) == {"model_source": {"prefill": "guess"}}
    assert InstanceModels(TERRIBLE, prior_trusted=True).source("p9", "prefill") == "prior"


def test_a_measured_part_lies_over_the_prior_and_keeps_the_rest():
    model = measured_model(TERRIBLE, FAST_PREFILL)
    assert model.prefill == (0.002, 2e-4, 0.0, 0.0) and model.decode == TERRIBLE.decode
    assert model.prefill_chunk == 512 and model.kv_bytes_per_token == TERRIBLE.kv_bytes_per_token


def test_the_simulator_runs_each_pool_on_its_own_model_and_the_conductor_predicts_with_it():
    base = CostModel((0.0, 1e-3, 0.0, 0.0), (0.01, 0.0, 0.0), 1000, "base")
    slow_decode = dataclasses.replace(base, decode=(0.05, 0.0, 0.0), source="slow")
    sim = Simulation(SchedulerConfig(block_size=100, rejection="never"), base,
                     ClusterSpec(prefill=1, decode=1, num_layers=1), pool_costs={"decode": slow_decode})
    requests = [SimRequest(f"r{i}", arrival_s=float(i), input_len=500, output_len=11, hashes=[]) for i in range(3)]
    records = sim.run(requests, sample_s=0)
    assert sim.conductor.registry.decode["d0"].cost.decode == slow_decode.decode
    assert sim.conductor.registry.prefill["p0"].cost is None  # its pool runs the shared model
    assert all(r.status == "completed" for r in records)
    assert records[0].tbt_s == pytest.approx(0.05, rel=0.01)
    assert sim.conductor.stats["tbt_rel_error_sum"] / sim.conductor.stats["tbt_outcomes"] < 0.05


def test_a_simulated_pool_announces_its_model_once():
    base = CostModel((0.0, 1e-3, 0.0, 0.0), (0.01, 0.0, 0.0), 1000, "base")
    sim = Simulation(SchedulerConfig(block_size=100), base, ClusterSpec(prefill=1, decode=1),
                     pool_costs={"prefill": base})
    prefill = sim.prefills["p0"]
    assert prefill.load_report(1.0).cost is None  # announced in the report the cluster sent at start
    assert as_measured(base, "p0").prefill == list(base.prefill)


def test_an_instance_that_measured_nothing_yet_is_predicted_and_judged_by_a_peer_of_its_role_and_cluster():
    core = conductor(prior_trusted=False, policy="cache_aware", ttft_slo_s=1.0)
    core.observe(prefill_report("p1"), 0.0)  # nothing measured: on its own, the prior's guess (1 s per 1000 tokens)
    core.observe(prefill_report("p2", cluster="elsewhere"), 0.0)
    announce(core, decode_cost=FAST_DECODE, prefill_cost=FAST_PREFILL)
    core.observe(prefill_report("p1"), 0.05)
    core.observe(prefill_report("p2", cluster="elsewhere"), 0.05)
    p1, p2 = core.registry.prefill["p1"], core.registry.prefill["p2"]
    assert p1.trusted and p1.cost is not None and p1.cost.prefill == (0.002, 2e-4, 0.0, 0.0)
    assert not p2.trusted and p2.cost is None  # no measured peer in its cluster
    assert core.models.source("p1", "prefill") == "peer" and core.models.source("p2", "prefill") == "guess"
    core.observe(decode_report("d1"), 0.05)
    assert core.models.source("d1", "decode") == "peer"  # d0's decode model; p0's prefill model is not a decode's
    assert core.registry.decode["d1"].cost.decode == (0.005, 1e-4, 1e-6)
