"""Long-term re-planning (PrfaaS §3.4.3): measured pool load -> role change between PD-P and PD-D."""

import pytest

from kvcentric.prfaas.planner import best_threshold, search
from kvcentric.prfaas.replan import PoolLoad, ReplanPolicy, best_split, recommend_role_change
from kvcentric.prfaas.profile import PrfaasProfile
from kvcentric.prfaas.throughput import Counts
from kvcentric.prfaas.workload import LengthDistribution

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
