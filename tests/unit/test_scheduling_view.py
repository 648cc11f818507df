"""The Conductor's view of a prefill candidate (core/scheduling/view.py, groups.py): built once per decision from
the whole last report, the placements in flight and the TTFT correction, and the only thing a policy is given."""

import msgspec
import pytest

from factories import make_conductor, prefill_report, prefill_view, schedule_request
from kvcentric.core.protocol import Placement
from kvcentric.core.scheduling.groups import PrefillGroups
from kvcentric.core.scheduling.policies import PrefillChoice, best_holder
from kvcentric.core.scheduling.registry import PrefillState
from kvcentric.core.scheduling.view import NO_PROMPT, PromptBlocks, instance_view
from kvcentric.core.sim.cluster import ClusterSpec, Simulation


class Recorder:
    """A placement policy that takes the first candidate and keeps every list of candidates it was given."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[list] = []

    def choose(self, request, candidates, now):
        self.seen.append(list(candidates))
        first = candidates[0]
        return PrefillChoice(first, first.queue_s + 1.0, 1.0, first.prefix_blocks, None, first.prefix_blocks)


def recording(conductor):
    recorder = conductor.policy = Recorder()
    return recorder


def state(instance_id, queue_end=0.0, pending=0, stage_of=None):
    report = prefill_report(instance_id)
    if stage_of is not None:
        report = msgspec.structs.replace(report, pipeline_group=stage_of[0], stage=stage_of[1], stages=stage_of[2])
    return PrefillState(instance_id, report.kv_addr, 0.0, "local", queue_end, pending, report=report)


def test_a_view_adds_the_placements_in_flight_to_the_reported_queue_and_load():
    conductor = make_conductor(1, 1)
    conductor.observe(prefill_report("p0", queue_s=0.5, queued_tokens=500), 0.0)
    assert isinstance(conductor.schedule(schedule_request(1000, "a"), {}, 0.1), Placement)  # 1 s in flight there
    (view,) = conductor.prefill_views(0.2)
    assert view.queue_s == pytest.approx(0.5 - 0.2 + 1.0)
    assert (view.load_tokens, view.in_flight) == (500 + 1000, 1)
    conductor.forget("a")
    (view,) = conductor.prefill_views(0.2)
    assert view.queue_s == pytest.approx(0.3) and (view.load_tokens, view.in_flight) == (500, 0)


def test_a_view_carries_the_whole_last_report_and_a_repeat_does_not_replace_it():
    conductor = make_conductor(0, 1)
    sent = msgspec.structs.replace(prefill_report("p0"), kv_bytes_sent=12345, seq=1)
    conductor.observe(sent, 0.0)
    conductor.observe(msgspec.structs.replace(sent, kv_bytes_sent=0, seq=2, repeat=True), 0.1)
    (view,) = conductor.prefill_views(0.2)
    assert view.report == sent  # every field, not only the ones the registry keeps


def test_a_policy_may_rank_by_any_field_of_the_report():
    class MostSent(Recorder):
        def choose(self, request, candidates, now):
            best = max(candidates, key=lambda c: c.report.kv_bytes_sent)
            return PrefillChoice(best, best.queue_s + 1.0, 1.0, 0, None, 0)

    conductor = make_conductor(3, 1)
    conductor.observe(prefill_report("p1", kv_bytes_sent=99), 0.0)
    conductor.policy = MostSent()
    assert conductor.schedule(schedule_request(1000), {}, 0.1).prefill_id == "p1"


def test_the_policy_sees_the_held_and_the_expected_blocks_apart():
    conductor = make_conductor(2, 1, expect_cache=True, rejection="never")
    first = conductor.schedule(schedule_request(1000, "first"), {"p0": 3}, 0.0)
    assert first.prefill_id == "p0"  # p0 is now expected to hold all 10 blocks of the prompt
    recorder = recording(conductor)
    conductor.schedule(schedule_request(1000, "second"), {"p0": 3, "p1": 2}, 0.1)
    views = {v.instance_id: v for v in recorder.seen[-1]}
    assert (views["p0"].prefix_blocks, views["p0"].held_blocks) == (10, 3)
    assert (views["p1"].prefix_blocks, views["p1"].held_blocks) == (2, 2)
    assert best_holder(recorder.seen[-1]) == (views["p0"], 10)
    assert best_holder(recorder.seen[-1], pullable=True) == (views["p0"], 3)  # expected blocks cannot be pulled


def test_below_the_cache_aware_minimum_no_candidate_holds_anything():
    conductor = make_conductor(2, 1, cache_aware_scheduling_min_tokens=1000)
    recorder = recording(conductor)
    conductor.schedule(schedule_request(999), {"p0": 8}, 0.1)
    assert [(v.prefix_blocks, v.held_blocks) for v in recorder.seen[-1]] == [(0, 0), (0, 0)]


def test_the_correction_reaches_the_policy_in_the_view_and_nowhere_else():
    conductor = make_conductor(2, 1, ttft_correction=True, rejection="never")
    conductor.correction.factors["p1"] = 2.5
    recorder = recording(conductor)
    conductor.schedule(schedule_request(1000), {}, 0.1)
    assert [(v.instance_id, v.correction) for v in recorder.seen[-1]] == [("p0", 1.0), ("p1", 2.5)]
    assert not hasattr(conductor.registry.prefill["p1"], "ttft_factor")


def test_without_a_correction_every_view_is_uncorrected():
    conductor = make_conductor(2, 1, ttft_correction=False)
    recorder = recording(conductor)
    conductor.schedule(schedule_request(1000), {}, 0.1)
    assert [v.correction for v in recorder.seen[-1]] == [1.0, 1.0]


def test_a_view_is_a_value_a_policy_cannot_write_through():
    view = prefill_view("p0", queue_s=1.0)
    with pytest.raises(AttributeError):
        view.queue_s = 0.0  # type: ignore[misc]


def test_an_instance_view_reads_its_state_and_the_prompt_once():
    p0 = state("p0", queue_end=2.0, pending=300)
    p0.in_flight.add("a", 0.5, 100, now=0.0)
    view = instance_view(p0, 1.0, PromptBlocks({"p0": 2}, {"p0": 5, "p9": 7}), correction=1.5)
    assert (view.queue_s, view.load_tokens, view.in_flight) == (pytest.approx(1.5), 400, 1)
    assert (view.prefix_blocks, view.held_blocks, view.correction) == (5, 2, 1.5)
    assert instance_view(p0, 3.0, NO_PROMPT).queue_s == pytest.approx(0.5)  # its reported queue drained


def test_a_group_is_split_from_the_whole_instances_only_when_every_stage_is_alive():
    groups = PrefillGroups(prior=None)
    stages = [state(f"g-s{i}", stage_of=("g", i, 2)) for i in range(2)]
    lone = state("h-s0", stage_of=("h", 0, 2))
    whole = state("p0")
    for member in (*stages, lone):
        groups.observe(member.report)
    assert groups.split([stages[1], whole, lone, stages[0]]) == ([whole], [stages])
    assert groups.split([whole]) == ([whole], [])


def test_a_group_view_takes_the_busiest_stage_the_common_prefix_and_the_first_stages_placements():
    from factories import simple_cost
    groups = PrefillGroups(simple_cost())
    head, tail = state("g-s0", queue_end=1.0, pending=200), state("g-s1", queue_end=3.0)
    head.in_flight.add("a", 0.25, 50, now=0.0)
    tail.trusted = False
    view = groups.view([head, tail], 0.5, PromptBlocks({"g-s0": 6, "g-s1": 4}, {"g-s0": 5}), correction=2.0)
    assert (view.instance_id, view.kv_addr, view.report) == ("g-s0", head.kv_addr, head.report)
    assert view.queue_s == pytest.approx(3.0 - 0.5 + 0.25)
    assert (view.load_tokens, view.in_flight) == (250, 1)
    assert (view.held_blocks, view.prefix_blocks) == (4, 5)
    assert view.pipeline_addrs == (tail.kv_addr,) and not view.trusted and view.correction == 2.0
    assert view.cost.source == "pipeline:2"


def test_what_is_placed_on_a_group_is_accounted_on_its_first_stage():
    conductor = make_conductor(0, 1)
    for i in range(2):
        conductor.observe(msgspec.structs.replace(prefill_report(f"g-s{i}"), pipeline_group="g", stage=i, stages=2),
                          0.0)
    decision = conductor.schedule(schedule_request(1000, "a"), {}, 0.1)
    assert decision.prefill_id == "g-s0"
    assert len(conductor.registry.prefill["g-s0"].in_flight) == 1
    assert len(conductor.registry.prefill["g-s1"].in_flight) == 0


def test_the_simulator_hands_its_policies_views_too():
    from factories import simple_cost
    from kvcentric.core.scheduling.config import SchedulerConfig
    from kvcentric.core.sim.workload import SimRequest
    sim = Simulation(SchedulerConfig(block_size=100, rejection="never"), simple_cost(),
                     ClusterSpec("disaggregated", 2, 1, link_bytes_per_s=1e12))
    recorder = recording(sim.conductor)
    records = sim.run([SimRequest("a", 0.0, 1000, 1, [f"x{i}" for i in range(10)])], sample_s=0)
    assert [r.prefill_id for r in records] == [recorder.seen[0][0].instance_id]
    assert {v.instance_id for v in recorder.seen[0]} == set(sim.prefills)


def policy_named(name):
    from factories import simple_cost
    from kvcentric.core.scheduling.estimators import Estimator, LinkTable
    from kvcentric.core.scheduling.policies import make_policy
    return make_policy(name, Estimator(simple_cost(), 100), LinkTable(100e9 / 8))


def test_a_policy_runs_on_views_alone_and_ranks_by_the_corrected_ttft():
    slowed, plain = prefill_view("p0", queue_s=0.5, correction=3.0), prefill_view("p1", queue_s=1.0)
    choice = policy_named("cache_aware").choose(schedule_request(1000), [slowed, plain], 0.0)
    assert choice.instance is plain  # (0.5 + 1) x 3 against (1 + 1) x 1
    assert choice.ttft_s == pytest.approx(2.0)  # the prediction itself is returned uncorrected


def test_kvcentric_pulls_only_what_a_candidate_holds_now():
    request = schedule_request(1000)
    expected_only = prefill_view("p0", queue_s=5.0, prefix=8, held=0)
    choice = policy_named("kvcentric").choose(request, [expected_only, prefill_view("p1")], 0.0)
    assert choice.instance.instance_id == "p1" and choice.source is None and choice.prefix_blocks == 0
    holder = prefill_view("p0", queue_s=5.0, prefix=8)
    choice = policy_named("kvcentric").choose(request, [holder, prefill_view("p1")], 0.0)
    assert choice.instance.instance_id == "p1" and choice.source is holder and choice.pull_blocks == 8
