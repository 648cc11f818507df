"""Chunked pipeline parallelism's pure parts (Mooncake §5.1): stage layer ranges, the chunk schedule, the
pipelined T_prefill, and the Conductor placing on prefill groups."""

import msgspec
import pytest

from factories import make_conductor, prefill_report, schedule_request, simple_cost
from kvcentric.core.costmodel import CostModel
from kvcentric.core.pipeline import (chunk_bounds, parse_stage, pipeline_steps, pipelined_makespan_s,
                                     pipelined_t_prefill, stage_layers)
from kvcentric.core.protocol import Placement, Rejection


def test_stages_split_the_layers_contiguously_and_evenly():
    assert [stage_layers(8, 2, i) for i in range(2)] == [range(0, 4), range(4, 8)]
    assert [list(stage_layers(10, 4, i)) for i in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [len(stage_layers(80, 4, i)) for i in range(4)] == [20] * 4
    with pytest.raises(ValueError):
        stage_layers(2, 3, 0)


@pytest.mark.parametrize("text, expected", [("0/2", (0, 2)), ("3/4", (3, 4)), (" 0/1 ", (0, 1))])
def test_a_stage_is_written_i_of_x(text, expected):
    assert parse_stage(text) == expected


@pytest.mark.parametrize("text", ["2/2", "1", "a/b", "0/0", "-1/2"])
def test_a_bad_stage_is_refused(text):
    with pytest.raises(ValueError):
        parse_stage(text)


def test_chunks_cover_the_uncached_tokens():
    assert chunk_bounds(1000, 0, 512) == [(0, 512), (512, 1000)]
    assert chunk_bounds(1000, 200, 512) == [(200, 712), (712, 1000)]
    assert chunk_bounds(5, 5, 512) == []


def test_stage_i_computes_chunk_c_while_stage_i_plus_1_computes_c_minus_1():
    steps = pipeline_steps(chunks=3, stages=2)
    assert steps == [[(0, 0)], [(0, 1), (1, 0)], [(0, 2), (1, 1)], [(1, 2)]]
    assert len(pipeline_steps(chunks=8, stages=4)) == 8 + 4 - 1


def test_equal_stages_take_the_slowest_stage_times_chunks_plus_x_minus_1():
    assert pipelined_makespan_s([[1.0] * 5] * 3) == pytest.approx(5 + 3 - 1)
    assert pipelined_makespan_s([[1.0] * 4, [2.0] * 4]) == pytest.approx(1 + 4 * 2)  # the slow stage sets the pace
    assert pipelined_makespan_s([[1.0] * 2, [1.0] * 2], hop_s=0.5) == pytest.approx(3.5)


def test_a_short_prompt_pays_almost_nothing_and_a_long_one_gains_about_x():
    cost = CostModel((0.0, 1e-3, 0.0, 0.0), (0.0, 0.0, 0.0), 1000)
    one = cost.t_prefill(512)
    assert pipelined_t_prefill([cost] * 2, 512, 0, 512, share=0.5) == pytest.approx(one)  # one chunk: no gain, no loss
    long_single = cost.t_prefill(16384)
    long_group = pipelined_t_prefill([cost] * 2, 16384, 0, 512, share=0.5)
    assert long_single / long_group == pytest.approx(2 * 32 / 33)


def group_report(instance_id, stage, stages=2, group="g0", queue_s=0.0):
    return msgspec.structs.replace(prefill_report(instance_id, queue_s), pipeline_group=group, stage=stage,
                                   stages=stages)


def test_a_group_is_one_candidate_named_by_its_first_stage_with_its_later_stages_addresses():
    conductor = make_conductor(0, 1)
    for stage in range(3):
        conductor.observe(group_report(f"g0-s{stage}", stage, 3), 0.0)
    decision = conductor.schedule(schedule_request(1000), {}, 0.1)
    assert isinstance(decision, Placement)
    assert decision.prefill_id == "g0-s0"
    assert decision.pipeline_addrs == ["g0-s1:7000", "g0-s2:7000"]


def test_a_group_with_a_stage_missing_is_no_candidate():
    conductor = make_conductor(0, 1)
    conductor.observe(group_report("g0-s0", 0), 0.0)
    assert isinstance(conductor.schedule(schedule_request(1000), {}, 0.1), Rejection)


def test_a_long_prompt_goes_to_the_group_and_prefix_hits_count_only_what_every_stage_holds():
    conductor = make_conductor(1, 1, policy="cache_aware")  # p0: a whole instance
    conductor.observe(group_report("g0-s0", 0), 0.0)
    conductor.observe(group_report("g0-s1", 1), 0.0)
    long = conductor.schedule(schedule_request(8000, "long"), {}, 0.1)
    assert isinstance(long, Placement) and long.prefill_id == "g0-s0" and long.pipeline_addrs == ["g0-s1:7000"]
    assert long.predicted_ttft_s == pytest.approx(pipelined_t_prefill([simple_cost()] * 2, 8000, 0, 512, 0.5))
    conductor = make_conductor(1, 1, policy="cache_aware")
    conductor.observe(group_report("g0-s0", 0), 0.0)
    conductor.observe(group_report("g0-s1", 1), 0.0)
    hits = {"p0": 60, "g0-s0": 80, "g0-s1": 10}  # the group holds 10 blocks on every stage: the whole one wins
    placed = conductor.schedule(schedule_request(8000, "cached"), hits, 0.1)
    assert isinstance(placed, Placement) and placed.prefill_id == "p0" and placed.pipeline_addrs == []


def test_what_is_placed_on_a_group_queues_on_it_until_its_first_stage_reports():
    conductor = make_conductor(0, 1, policy="load_balance")
    for group in ("a", "b"):
        conductor.observe(group_report(f"{group}-s0", 0, group=group), 0.0)
        conductor.observe(group_report(f"{group}-s1", 1, group=group), 0.0)
    first = conductor.schedule(schedule_request(4000, "1"), {}, 0.1)
    second = conductor.schedule(schedule_request(4000, "2"), {}, 0.1)
    assert {first.prefill_id, second.prefill_id} == {"a-s0", "b-s0"}


def simulate_groups(requests, stages, prefill=1):
    from kvcentric.core.scheduling.config import SchedulerConfig
    from kvcentric.core.sim.cluster import ClusterSpec, Simulation
    spec = ClusterSpec("disaggregated", prefill, 1, link_bytes_per_s=1e12, num_layers=10, prefill_pipeline=stages,
                       prefill_chunk=512)
    sim = Simulation(SchedulerConfig(block_size=100, rejection="never"), simple_cost(), spec)
    return {r.request.request_id: r for r in sim.run(requests, sample_s=0)}


def sim_request(name, at, n, prefix):
    from kvcentric.core.sim.workload import SimRequest
    return SimRequest(name, at, n, 1, [f"{prefix}{i}" for i in range(-(-n // 100))])


def test_the_simulator_places_on_groups_and_computes_at_their_pipelined_pace():
    records = simulate_groups([sim_request("long", 0.0, 8000, "a")], stages=2)
    assert records["long"].prefill_id == "p0-s0"
    expected = pipelined_t_prefill([simple_cost()] * 2, 8000, 0, 512, 0.5)
    assert records["long"].ttft_s == pytest.approx(expected, rel=1e-3)
    assert records["long"].predicted_ttft_s == pytest.approx(expected, rel=1e-3)
    assert expected < simple_cost().t_prefill(8000) * 0.6


def test_a_simulated_group_reuses_the_prefix_it_computed():
    records = simulate_groups([sim_request("a", 0.0, 2000, "x"), sim_request("b", 50.0, 2000, "x")], stages=2)
    assert records["b"].cached_blocks == 20 and records["b"].ttft_s < records["a"].ttft_s / 10
