"""The Conductor core end to end: instances, dispatch-time accounting, outcomes, colocated placement."""

import pytest

from factories import decode_report, load_report, make_conductor, prefill_report, schedule_request
from kvcentric.core.protocol import Placement, Rejection, RequestOutcome


def test_no_engines_gives_a_no_instance_rejection_naming_the_missing_role():
    conductor = make_conductor(1, 0)
    decision = conductor.schedule(schedule_request(), {}, 0.0)
    assert isinstance(decision, Rejection)
    assert decision.reason == "no_instance" and "decode" in decision.message


def test_least_loaded_prefill_and_decode_are_chosen():
    conductor = make_conductor(0, 0, policy="load_balance")
    for report in (load_report("p0", "prefill", queued_tokens=500), load_report("p1", "prefill"),
                   load_report("d0", "decode", running=3), load_report("d1", "decode", running=1)):
        conductor.observe(report, 0.0)
    decision = conductor.schedule(schedule_request(100), {}, 0.1)
    assert isinstance(decision, Placement)
    assert (decision.prefill_id, decision.decode_id) == ("p1", "d1")
    assert decision.decode_kv_addr == load_report("d1", "decode").kv_addr


def test_dispatches_since_the_last_report_count_as_queued_time():
    conductor = make_conductor(2, 1, policy="load_balance")
    first = conductor.schedule(schedule_request(1000, "a"), {}, 0.1)
    second = conductor.schedule(schedule_request(1000, "b"), {}, 0.1)
    assert {first.prefill_id, second.prefill_id} == {"p0", "p1"}
    third = conductor.schedule(schedule_request(1000, "c"), {}, 0.1)
    assert third.predicted_ttft_s == pytest.approx(2.0)  # 1 s queued ahead of it + its own 1 s


def test_a_new_report_replaces_dispatch_estimates():
    conductor = make_conductor(1, 1)
    conductor.schedule(schedule_request(3000), {}, 0.0)
    state = conductor.registry.prefill["p0"]
    assert state.queue_s(0.0) == pytest.approx(3.0) and state.load_tokens == 3000
    conductor.observe(prefill_report("p0", queue_s=1.2, queued_tokens=1200), 0.5)
    assert state.queue_s(0.5) == pytest.approx(1.2) and state.load_tokens == 1200
    assert state.queue_s(1.0) == pytest.approx(0.7)


def test_without_an_engine_estimate_the_queue_is_the_linear_part_of_the_cost_model():
    conductor = make_conductor(0, 1)
    conductor.observe(load_report("p0", "prefill", queued_tokens=2500), 0.0)
    assert conductor.registry.prefill["p0"].queue_s(0.0) == pytest.approx(2.5)


def test_instances_without_recent_reports_are_not_placed():
    conductor = make_conductor(1, 1)
    assert isinstance(conductor.schedule(schedule_request(), {}, 0.5), Placement)
    assert isinstance(conductor.schedule(schedule_request(), {}, 5.0), Rejection)
    assert conductor.registry.snapshot(5.0) == []


def test_snapshot_lists_alive_instances_with_their_load():
    conductor = make_conductor(1, 1)
    conductor.observe(decode_report("d0", running=3), 0.0)
    loads = {(i.instance_id, i.role): i.load for i in conductor.registry.snapshot(0.2)}
    assert loads == {("p0", "prefill"): 0.0, ("d0", "decode"): 3.0}


def outcome(request_id, ttft_s, e2e_s, tokens=100, prefill_id="p0", decode_id="d0"):
    return RequestOutcome(request_id=request_id, prefill_id=prefill_id, decode_id=decode_id, finish_reason="length",
                          ttft_s=ttft_s, e2e_s=e2e_s, prompt_tokens=1000, completion_tokens=tokens)


def test_outcomes_record_the_ttft_prediction_error_and_teach_the_decode_time():
    conductor = make_conductor(1, 1, decode_time_s=10.0)
    placed = conductor.schedule(schedule_request(1000, "a"), {}, 0.0)
    assert placed.predicted_ttft_s == pytest.approx(1.0)
    conductor.on_outcome(outcome("a", ttft_s=1.25, e2e_s=21.25), 30.0)
    assert conductor.stats["outcomes"] == 1
    assert conductor.stats["ttft_error_sum_s"] == pytest.approx(-0.25)
    assert conductor.stats["ttft_rel_error_sum"] == pytest.approx(0.2)
    assert conductor.t_d == pytest.approx(10.0 + 0.05 * (20.0 - 10.0))
    assert "a" not in conductor.pending and len(conductor.registry.decode["d0"].forecast) == 0


def test_an_outcome_of_an_unknown_request_changes_nothing():
    conductor = make_conductor(1, 1)
    conductor.on_outcome(outcome("ghost", 1.0, 2.0), 0.0)
    assert conductor.stats["outcomes"] == 0


def test_forget_drops_a_request_from_the_decode_forecast():
    conductor = make_conductor(1, 1)
    conductor.schedule(schedule_request(1000, "a"), {}, 0.0)
    conductor.forget("a")
    assert len(conductor.registry.decode["d0"].forecast) == 0 and not conductor.pending


def test_colocated_placement_decodes_where_it_prefilled():
    conductor = make_conductor(0, 0, policy="load_balance")
    for name in ("c0", "c1"):
        conductor.observe(prefill_report(name), 0.0)
        conductor.observe(decode_report(name), 0.0)
    conductor.observe(prefill_report("c0", queue_s=3.0), 0.0)
    decision = conductor.schedule(schedule_request(), {}, 0.1)
    assert decision.prefill_id == decision.decode_id == "c1"


def test_colocated_rejects_on_the_chosen_instances_decode_load():
    conductor = make_conductor(0, 0, rejection="early", tbt_slo_s=0.015)
    conductor.observe(prefill_report("c0"), 0.0)
    conductor.observe(decode_report("c0", running=8), 0.0)
    decision = conductor.schedule(schedule_request(), {}, 0.1)
    assert isinstance(decision, Rejection) and decision.stage == "decode"


def test_placements_and_rejections_are_counted():
    conductor = make_conductor(1, 1, ttft_slo_s=1.5)
    conductor.schedule(schedule_request(1000, "a"), {}, 0.0)
    conductor.schedule(schedule_request(1000, "b"), {}, 0.0)  # 2 s > 1.5 s
    assert conductor.stats["placed"] == 1 and conductor.stats["rejected_prefill"] == 1


def test_measured_link_bandwidth_in_reports_feeds_the_transfer_estimate():
    conductor = make_conductor(2, 1, policy="kvcentric")
    report = prefill_report("p0", queue_s=5.0)
    conductor.observe(type(report)(**{**{f: getattr(report, f) for f in report.__struct_fields__},
                                      "link_bandwidth": {"p1:7000": 1e6}}), 0.0)
    assert conductor.links.bytes_per_s("p0", "p1") == 1e6
    decision = conductor.schedule(schedule_request(1000), {"p0": 8}, 0.1)
    assert decision.prefill_id == "p1" and decision.predicted_ttft_s == pytest.approx(0.8 + 0.2)
