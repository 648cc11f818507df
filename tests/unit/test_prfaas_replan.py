"""Long-term re-planning (PrfaaS §3.4.3): measured pool load -> role change between PD-P and PD-D."""

import pytest

from kvcentric.core.prfaas.planner import best_threshold, search
from kvcentric.core.prfaas.replan import PoolLoad, ReplanPolicy, best_split, recommend_role_change
from kvcentric.core.prfaas.profile import PrfaasProfile
from kvcentric.core.prfaas.throughput import Counts
from kvcentric.core.prfaas.workload import LengthDistribution

SPREAD = LengthDistribution.from_samples([1000, 2000, 4000, 8000, 16000, 32000], output_length=100)


def toy_profile() -> PrfaasProfile:
    return PrfaasProfile.from_dict({
        "prfaas": {"lengths": [1000, 100000], "prefill_s": [0.5, 50.0], "kv_mib": [10, 1000]},
        "pd_prefill": {"lengths": [1000, 100000], "prefill_s": [1.0, 100.0]},
        "decode": {"tokens_per_s": 100}, "egress_gbps": 100})


def test_saturated_prefill_with_idle_decode_takes_a_decode_instance():
    change = recommend_role_change(PoolLoad(3, 1.0, queued_s=600), PoolLoad(5, 0.3))
    assert (change.action, change.count, change.n_prefill, change.n_decode) == ("decode_to_prefill", 1, 4, 4)
    assert change.pressure_before[0] == pytest.approx((3 + 2) / 3)  # 3 busy + 600 s / 300 s window
    assert max(change.pressure_after) < max(change.pressure_before)
    assert "prefill is the bottleneck" in change.reason


def test_saturated_decode_takes_a_prefill_instance():
    change = recommend_role_change(PoolLoad(6, 0.2), PoolLoad(2, 1.0, queued_s=300))
    assert (change.action, change.n_prefill, change.n_decode) == ("prefill_to_decode", 5, 3)


def test_larger_steps_go_straight_to_the_balanced_split():
    policy = ReplanPolicy(max_step=8)
    change = recommend_role_change(PoolLoad(6, 0.25), PoolLoad(2, 1.0, queued_s=300), policy)
    assert best_split(1.5, 3.0, 8, policy) == 3  # pressures 0.5 and 0.6; 2/6 gives 0.75, 4/4 gives 0.75
    assert (change.count, change.n_prefill, change.n_decode) == (3, 3, 5)
    assert best_split(1.2, 3.0, 8, policy) == 2  # 2/6 and 3/5 tie at 0.6: the fewer prefill instances


def test_mild_imbalance_and_idle_pools_change_nothing():
    assert recommend_role_change(PoolLoad(3, 0.7), PoolLoad(5, 0.6)).action == "none"  # within 1.25x
    idle = recommend_role_change(PoolLoad(3, 0.0), PoolLoad(5, 0.0))
    assert idle.action == "none" and "idle" in idle.reason


def test_minimum_pool_sizes_are_kept():
    change = recommend_role_change(PoolLoad(1, 1.0, 900), PoolLoad(1, 0.0))
    assert change.action == "none"  # moving the only decode instance would leave none
    with pytest.raises(ValueError):
        best_split(1.0, 1.0, 1, ReplanPolicy())


def test_a_move_that_would_not_help_is_not_made():
    # 4 instances of demand on each side of 2 + 2: any move makes one side worse.
    assert recommend_role_change(PoolLoad(2, 1.0, 600), PoolLoad(2, 1.0, 600)).action == "none"


def test_bad_loads_are_refused():
    with pytest.raises(ValueError):
        PoolLoad(2, 1.5)
    with pytest.raises(ValueError):
        ReplanPolicy(imbalance=0.5)


def test_threshold_is_re_optimised_for_the_new_counts():
    profile = toy_profile()
    best = search(profile, SPREAD, 2, 6)[0]
    again = best_threshold(profile, SPREAD, best.counts)
    assert again.threshold == pytest.approx(best.threshold) and again.lambda_max == pytest.approx(best.lambda_max)
    more_local = best_threshold(profile, SPREAD, Counts(2, best.counts.pd_prefill + 1, best.counts.decode - 1))
    assert more_local.threshold >= best.threshold  # more PD-P capacity keeps more requests local
    thin = best_threshold(profile.with_egress(0.05), SPREAD, best.counts)
    assert thin.threshold >= best.threshold and thin.egress_gbps <= 0.05 * (1 + 1e-9)


# ---------------------------------------------------------------- draining instances and the live re-planner

def _draining(report):
    import msgspec
    return msgspec.structs.replace(report, draining=True)


def test_a_draining_instance_gets_no_new_placement():
    from factories import decode_report, make_conductor, prefill_report, schedule_request
    conductor = make_conductor(prefills=2, decodes=2)
    conductor.observe(_draining(prefill_report("p0")), 0.1)
    conductor.observe(_draining(decode_report("d1")), 0.1)
    for i in range(6):
        placement = conductor.schedule(schedule_request(request_id=f"r{i}"), {"p0": 10}, 0.2)
        assert (placement.prefill_id, placement.decode_id) == ("p1", "d0")


def test_a_switched_instance_is_not_mistaken_for_a_colocated_one():
    """d0 drained and came back as a prefill instance: its old decode entry must not make the conductor
    decode on it what it prefills."""
    from factories import decode_report, make_conductor, prefill_report, schedule_request
    conductor = make_conductor(prefills=0, decodes=2)
    conductor.observe(_draining(decode_report("d0")), 0.1)
    conductor.observe(prefill_report("d0"), 0.2)
    placement = conductor.schedule(schedule_request(), {}, 0.3)
    assert (placement.prefill_id, placement.decode_id) == ("d0", "d1")


def _registry_states(conductor, now):
    return conductor.registry.alive_prefill(now), conductor.registry.alive_decode(now)


def test_the_replanner_moves_an_idle_prefill_instance_to_a_backlogged_decode_pool():
    from factories import decode_report, make_conductor, prefill_report
    from kvcentric.core.prfaas.replan import Replanner
    import msgspec
    conductor = make_conductor(prefills=3, decodes=1)
    planner = Replanner(ReplanPolicy(window_s=10.0), bs_max=4, decode_time_s=2.0)
    for step in range(20):
        now = step * 0.5
        conductor.observe(prefill_report("p0", queue_s=0.5), now)  # p0 busy, p1 and p2 idle
        for idle in ("p1", "p2"):
            conductor.observe(prefill_report(idle), now)
        conductor.observe(msgspec.structs.replace(decode_report("d0", running=4), queued_requests=20), now)
        planner.observe(*_registry_states(conductor, now), now)
    switch = planner.decide(*_registry_states(conductor, 9.5), 9.5)
    assert switch is not None and switch.to_role == "decode" and switch.change.action == "prefill_to_decode"
    assert switch.instance_ids == ("p1",)  # the least loaded (ties by id), never the busy p0
    assert planner.decide(*_registry_states(conductor, 9.6), 9.6) is None  # quiet for a window after a switch


def test_the_replanner_leaves_a_balanced_cluster_alone():
    from factories import decode_report, make_conductor, prefill_report
    from kvcentric.core.prfaas.replan import Replanner
    conductor = make_conductor(prefills=2, decodes=2)
    planner = Replanner(ReplanPolicy(window_s=5.0), bs_max=4, decode_time_s=1.0)
    for step in range(10):
        now = step * 0.5
        for name in ("p0", "p1"):
            conductor.observe(prefill_report(name, queue_s=0.2), now)
        for name in ("d0", "d1"):
            conductor.observe(decode_report(name, running=4), now)
        planner.observe(*_registry_states(conductor, now), now)
    assert planner.decide(*_registry_states(conductor, 4.5), 4.5) is None
    assert planner.last.action == "none"
