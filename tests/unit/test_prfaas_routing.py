"""PrfaaS §3.3/§3.4.3 routing on hand-built two-cluster cases, and the short-term threshold rule."""

import pytest

from kvcentric.core.prfaas.routing import ShortTermPolicy, adjust_threshold, bandwidth_is_scarce, route

T = 10_000  # threshold t


def two(total, pd=0, prfaas=0, scarce=True, threshold=T):
    return route(total, {"pd-a": pd, "prfaas-b": prfaas}, "pd-a", ["prfaas-b"], threshold, scarce)


def test_short_uncached_requests_stay_local_and_long_ones_go_to_prfaas():
    short = two(8_000)
    assert (short.target, short.cluster, short.uncached, short.kv_to_pd_tokens) == ("pd", "pd-a", 8_000, 0)
    long = two(30_000)
    assert (long.target, long.cluster, long.uncached) == ("prfaas", "prfaas-b", 30_000)
    assert long.kv_to_pd_tokens == 30_000 and long.cache_source is None


def test_the_threshold_applies_to_the_uncached_length_not_the_total():
    hit = two(30_000, pd=25_000)  # l = 5,000 <= t although l_total = 30,000
    assert hit.target == "pd" and hit.cached == 25_000 and hit.uncached == 5_000
    assert two(10_000).target == "pd" and two(10_001).target == "prfaas"  # l <= t stays local


def test_scarce_bandwidth_judges_each_clusters_prefix_on_its_own():
    # PrfaaS holds 28K of a 30K prompt, PD nothing: l = 30K - l_pd > t, so PrfaaS, which reuses its own 28K.
    decision = two(30_000, pd=0, prfaas=28_000, scarce=True)
    assert (decision.target, decision.cached, decision.uncached, decision.transfer_tokens) == \
        ("prfaas", 28_000, 2_000, 0)
    assert decision.kv_to_pd_tokens == 30_000  # PD holds none of it, so all of the KV crosses the link
    # PD holds 15K, PrfaaS 28K: still l_total - l_pd = 15K > t, to PrfaaS, nothing moves between caches.
    decision = two(30_000, pd=15_000, prfaas=28_000, scarce=True)
    assert decision.target == "prfaas" and decision.cache_source is None and decision.kv_to_pd_tokens == 15_000


def test_ample_bandwidth_uses_the_best_prefix_anywhere_and_moves_it():
    # Best prefix (28K) is in PrfaaS: l = 2K <= t, so PD-P computes, after pulling 28K of prefix across.
    decision = two(30_000, pd=0, prfaas=28_000, scarce=False)
    assert (decision.target, decision.cluster, decision.cache_source) == ("pd", "pd-a", "prfaas-b")
    assert decision.transfer_tokens == 28_000 and decision.cached == 28_000 and decision.uncached == 2_000
    # Only what PD lacks moves: PD holds 20K, PrfaaS 28K.
    assert two(30_000, pd=20_000, prfaas=28_000, scarce=False).transfer_tokens == 8_000


def test_ample_bandwidth_long_request_with_the_prefix_in_pd_pushes_it_to_prfaas():
    decision = two(60_000, pd=20_000, prfaas=0, scarce=False)  # l = 40K > t even with the best prefix
    assert (decision.target, decision.cluster, decision.cache_source, decision.transfer_tokens) == \
        ("prfaas", "prfaas-b", "pd-a", 20_000)
    assert decision.uncached == 40_000 and decision.kv_to_pd_tokens == 40_000


def test_equal_prefixes_move_nothing():
    decision = two(30_000, pd=25_000, prfaas=25_000, scarce=False)
    assert decision.target == "pd" and decision.cache_source is None and decision.transfer_tokens == 0


def test_several_prfaas_clusters_the_longest_prefix_wins():
    decision = route(50_000, {"pd": 0, "p1": 1_000, "p2": 9_000}, "pd", ["p1", "p2"], T, bandwidth_scarce=True)
    assert decision.cluster == "p2" and decision.uncached == 41_000


def test_without_a_prfaas_cluster_everything_is_local():
    assert route(90_000, {}, "pd", [], T, bandwidth_scarce=False).target == "pd"


@pytest.mark.parametrize("total, prefixes", [(0, {}), (100, {"pd-a": 101}), (100, {"elsewhere": 5})])
def test_bad_requests_are_refused(total, prefixes):
    with pytest.raises(ValueError):
        route(total, prefixes, "pd-a", ["prfaas-b"], T, True)


def test_scarcity_follows_egress_utilization():
    assert not bandwidth_is_scarce(0.3) and bandwidth_is_scarce(0.9)
    assert bandwidth_is_scarce(0.3, ShortTermPolicy(scarce_above=0.2))


def test_threshold_rises_when_egress_or_prfaas_queue_nears_its_limit():
    up = adjust_threshold(20_000, 20_000, egress_utilization=0.85, prfaas_queue_s=0)
    assert up.changed and up.threshold == pytest.approx(25_000)
    assert adjust_threshold(20_000, 20_000, 0.1, prfaas_queue_s=30).threshold == pytest.approx(25_000)
    capped = adjust_threshold(20_000, 20_000, 0.9, 0, policy=ShortTermPolicy(max_threshold=22_000))
    assert capped.threshold == 22_000


def test_threshold_returns_to_the_plan_step_by_step_when_calm():
    back = adjust_threshold(31_250, 20_000, egress_utilization=0.2, prfaas_queue_s=0.5)
    assert back.changed and back.threshold == pytest.approx(25_000)
    assert adjust_threshold(21_000, 20_000, 0.2, 0.5).threshold == pytest.approx(20_000)  # not below the plan
    steady = adjust_threshold(20_000, 20_000, 0.6, 0.5)  # between the watermarks
    assert not steady.changed and steady.threshold == 20_000


def test_a_long_local_queue_with_prfaas_idle_lowers_the_threshold():
    down = adjust_threshold(20_000, 20_000, 0.1, 0.0, local_queue_s=30)
    assert down.changed and down.threshold == pytest.approx(16_000)
    assert adjust_threshold(16_000, 20_000, 0.1, 0.0, local_queue_s=1).threshold == pytest.approx(20_000)


def test_short_term_policy_refuses_inconsistent_watermarks():
    with pytest.raises(ValueError):
        ShortTermPolicy(egress_low=0.9, egress_high=0.8)
