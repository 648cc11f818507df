"""The simulator on tiny hand-built workloads (cost model of tests/factories.py: 1 s per 1000 new tokens,
decode steps of 10 ms + 1 ms per sequence, 100-token blocks): timing, caching, pulls, rejections, colocation."""

import math

import pytest

from factories import simple_cost
from kvcentric.core.scheduling.config import SchedulerConfig
from kvcentric.core.sim.cluster import ClusterSpec, Simulation
from kvcentric.core.sim.metrics import summarize
from kvcentric.core.sim.workload import SimRequest


def req(name, at, n=1000, out=11, prefix="a", blocks=None):
    count = blocks if blocks is not None else -(-n // 100)
    return SimRequest(name, at, n, out, [f"{prefix}{i}" for i in range(count)])


def simulate(requests, prefill=1, decode=1, architecture="disaggregated", instances=1, chunk=0, **settings):
    settings.setdefault("block_size", 100)
    settings.setdefault("rejection", "never")
    spec = ClusterSpec(architecture, prefill, decode, instances, chunk, link_bytes_per_s=1e12, num_layers=10)
    sim = Simulation(SchedulerConfig(**settings), simple_cost(), spec)
    return sim, {r.request.request_id: r for r in sim.run(requests, sample_s=0)}


def test_one_request_takes_its_prefill_then_one_step_per_token():
    _, records = simulate([req("r", 0.0)])
    record = records["r"]
    assert record.status == "completed" and record.ttft_s == pytest.approx(1.0, abs=1e-3)
    assert record.tbt_s == pytest.approx(0.011, rel=0.05)  # 10 ms + 1 ms for its one sequence
    assert record.predicted_ttft_s == pytest.approx(1.0)


def test_a_repeated_prefix_is_reused_from_the_instances_host_cache():
    _, records = simulate([req("a", 0.0), req("b", 5.0)])
    assert records["a"].cached_blocks == 0 and records["b"].cached_blocks == 10
    assert records["b"].ttft_s == pytest.approx(0.001, abs=1e-3)  # only the last token is computed


def test_queued_requests_wait_and_the_prediction_includes_the_queue():
    _, records = simulate([req("a", 0.0), req("b", 0.0, prefix="b")])
    assert records["b"].ttft_s == pytest.approx(2.0, abs=1e-3)
    assert records["b"].predicted_ttft_s == pytest.approx(2.0, abs=1e-3)


def hot_prefix_workload():
    """a leaves 20 blocks on p0; "busy" extends that prefix, so it goes to p0 and keeps it busy; b then
    wants the same 20 blocks while their holder is busy."""
    return [req("a", 0.0, n=2000), req("busy", 2.5, n=5000), req("b", 3.0, n=2000)]


def test_kvcentric_pulls_a_hot_prefix_to_an_idle_instance_and_replicates_it():
    sim, records = simulate(hot_prefix_workload(), prefill=2, policy="kvcentric")
    a, busy, b = records["a"], records["busy"], records["b"]
    assert a.prefill_id == busy.prefill_id == "p0" and busy.cached_blocks == 20
    assert b.prefill_id == "p1" and b.pulled_blocks == 20 and b.cached_blocks == 20
    assert b.ttft_s == pytest.approx(0.001, abs=1e-3)
    assert set(sim.index.match([f"a{i}" for i in range(20)])) == {"p0", "p1"}  # replicated


def test_cache_aware_recomputes_instead_of_pulling():
    _, records = simulate(hot_prefix_workload(), prefill=2, policy="cache_aware")
    assert records["b"].prefill_id == "p1" and records["b"].pulled_blocks == 0
    assert records["b"].ttft_s == pytest.approx(2.0, abs=1e-3)


def test_none_mode_wastes_the_prefill_of_a_request_decode_refuses():
    workload = [req(f"r{i}", 0.0, prefix=f"p{i}", out=200) for i in range(6)]
    _, records = simulate(workload, prefill=6, rejection="none", tbt_slo_s=0.0135)
    statuses = sorted(r.status for r in records.values())
    assert statuses.count("rejected_after_prefill") == 3 and statuses.count("completed") == 3


def test_predictive_rejects_them_before_prefill_instead():
    workload = [req(f"r{i}", 0.0, prefix=f"p{i}", out=200) for i in range(6)]
    _, records = simulate(workload, prefill=6, rejection="predictive", tbt_slo_s=0.0135)
    statuses = sorted(r.status for r in records.values())
    assert statuses.count("rejected_before_prefill") == 3 and statuses.count("completed") == 3


def test_a_one_token_output_completes_at_its_first_token():
    _, records = simulate([req("r", 0.0, out=1)])
    assert records["r"].status == "completed" and records["r"].finish == records["r"].first_token


def colocated_pair(chunk):
    workload = [req("running", 0.0, n=100, out=400), req("long", 0.5, n=3000, prefix="x", out=2)]
    return simulate(workload, architecture="colocated", instances=1, chunk=chunk, policy="load_balance")[1]


def test_colocated_prefill_stalls_the_running_decode_and_chunking_spreads_it():
    whole, chunked = colocated_pair(0), colocated_pair(512)
    plain_tbt = 0.011
    assert whole["running"].tbt_s > plain_tbt + 2.9 / 399  # a 3 s stall in one gap
    assert whole["long"].ttft_s == pytest.approx(3.0, abs=0.02)
    assert chunked["long"].ttft_s > whole["long"].ttft_s  # chunks share steps with the decode
    assert chunked["running"].finish > 0 and whole["running"].decode_id == "c0"
    assert whole["running"].max_gap_s > 2.9 and whole["running"].slow_gaps == 1
    assert 0.011 < chunked["running"].max_gap_s < 1.0 < chunked["running"].slow_gaps


def test_summary_has_every_required_key_and_counts_slo_attainment():
    _, records = simulate([req("a", 0.0), req("b", 0.0, prefix="b")], ttft_slo_s=1.5)
    summary = summarize(list(records.values()), ttft_slo_s=1.5, tbt_slo_s=0.1)
    for key in ("requests", "completed", "completed_within_slo", "rejected_before_prefill", "rejected_after_prefill",
                "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tbt_p50_s", "tbt_p90_s", "tbt_p99_s",
                "slo_attainment", "goodput_rps", "prefix_hit_ratio"):
        assert key in summary
    assert summary["completed"] == 2 and summary["completed_within_slo"] == 1 and summary["slo_attainment"] == 0.5
    assert math.isclose(summary["ttft_mean_s"], 1.5, abs_tol=1e-3)
