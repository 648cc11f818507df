"""Each placement policy on hand-built clusters (tests/factories.py: 1 s per 1000 new tokens, 100-token blocks)."""

import math

import pytest

from factories import make_conductor, prefill_report, schedule_request
from kvcentric.core.protocol import Placement


def place(conductor, hits, n_tokens=1000, request_id="r", now=0.1):
    decision = conductor.schedule(schedule_request(n_tokens, request_id), hits, now)
    assert isinstance(decision, Placement), decision
    return decision


def test_random_spreads_over_every_instance_and_repeats_with_its_seed():
    picks = [place(make_conductor(4, policy="random", rejection="never", seed=s), {}).prefill_id for s in range(40)]
    assert set(picks) == {"p0", "p1", "p2", "p3"}
    again = [place(make_conductor(4, policy="random", rejection="never", seed=s), {}).prefill_id for s in range(40)]
    assert picks == again


def test_load_balance_takes_the_shortest_queue_and_ignores_where_the_prefix_is():
    conductor = make_conductor(2, policy="load_balance")
    conductor.observe(prefill_report("p0", queue_s=0.5), 0.0)
    decision = place(conductor, {"p0": 10})
    assert decision.prefill_id == "p1" and decision.cached_tokens == 0
    assert decision.predicted_ttft_s == pytest.approx(1.0)


def test_cache_aware_follows_the_prefix_while_its_queue_is_short():
    conductor = make_conductor(2, policy="cache_aware")
    conductor.observe(prefill_report("p0", queue_s=0.5), 0.0)
    decision = place(conductor, {"p0": 8})  # p0: 0.5 + 0.2 s; p1: 1.0 s
    assert decision.prefill_id == "p0" and decision.cached_tokens == 800
    assert decision.predicted_ttft_s == pytest.approx(0.5 - 0.1 + 0.2)  # report 0.1 s old


def test_cache_aware_leaves_the_prefix_when_the_holder_is_too_busy_and_never_pulls():
    conductor = make_conductor(2, policy="cache_aware")
    conductor.observe(prefill_report("p0", queue_s=5.0), 0.0)
    decision = place(conductor, {"p0": 8})
    assert decision.prefill_id == "p1" and decision.cached_tokens == 0 and decision.kv_source_id == ""


def test_kvcentric_pulls_the_hot_prefix_to_an_idle_instance():
    conductor = make_conductor(2, policy="kvcentric")
    conductor.observe(prefill_report("p0", queue_s=5.0), 0.0)
    request = schedule_request(1000)
    decision = conductor.schedule(request, {"p0": 8}, 0.1)
    assert decision.prefill_id == "p1" and decision.cached_tokens == 800
    assert decision.kv_source_id == "p0" and decision.kv_source_addr == "p0:7000"
    assert decision.pull_block_hashes == request.block_hashes[:8]
    transfer = 8 * 100 * 1000 / (100e9 / 8)
    assert decision.predicted_ttft_s == pytest.approx(transfer + 0.2)


def test_kvcentric_pulls_only_the_blocks_the_instance_lacks():
    conductor = make_conductor(2, policy="kvcentric", kvcache_balancing_threshold=2.0)
    conductor.observe(prefill_report("p0", queue_s=5.0), 0.0)
    decision = place(conductor, {"p0": 9, "p1": 4})  # 9 > 4 * 2: pull blocks 4..8
    assert decision.prefill_id == "p1" and decision.pull_block_hashes == [f"h{i}" for i in range(4, 9)]


def test_kvcentric_computes_locally_when_the_best_prefix_is_within_the_threshold():
    conductor = make_conductor(2, policy="kvcentric", kvcache_balancing_threshold=2.0)
    conductor.observe(prefill_report("p0", queue_s=5.0), 0.0)
    decision = place(conductor, {"p0": 8, "p1": 5})  # 8 <= 5 * 2: no pull
    assert decision.prefill_id == "p1" and decision.cached_tokens == 500 and decision.kv_source_id == ""


def test_kvcentric_with_an_infinite_threshold_is_cache_aware():
    for hits, queue in (({"p0": 8}, 5.0), ({"p0": 8}, 0.5), ({"p0": 3, "p1": 6}, 1.0)):
        decisions = []
        for policy, threshold in (("kvcentric", math.inf), ("cache_aware", 2.0)):
            conductor = make_conductor(2, policy=policy, kvcache_balancing_threshold=threshold)
            conductor.observe(prefill_report("p0", queue_s=queue), 0.0)
            decisions.append(place(conductor, hits))
        assert decisions[0] == decisions[1]


def test_kvcentric_avoids_a_congested_source_link():
    conductor = make_conductor(2, policy="kvcentric", link_gbps=0.008)  # 1 MB/s: 0.8 s per 8 blocks
    conductor.observe(prefill_report("p0", queue_s=1.5), 0.0)
    first = place(conductor, {"p0": 8}, request_id="a")
    assert first.prefill_id == "p1" and first.kv_source_id == "p0"  # 0.8 + 0.2 < 1.4 + 0.2
    second = place(conductor, {"p0": 8}, request_id="b")
    # p0's egress now holds 0.8 s of bytes: pulling again costs 1.6 s + p1's queue; p0 itself is cheaper.
    assert second.prefill_id == "p0" and second.kv_source_id == ""


def test_llumnix_adds_uncached_tokens_to_the_waiting_prefill_tokens():
    conductor = make_conductor(3, policy="llumnix")
    conductor.observe(prefill_report("p0", queued_tokens=300), 0.0)
    conductor.observe(prefill_report("p1", queued_tokens=100), 0.0)
    decision = place(conductor, {"p0": 8, "p1": 2})  # p0: 200+300, p1: 800+100, p2: 1000+0
    assert decision.prefill_id == "p0" and decision.cached_tokens == 800


def test_llumnix_breaks_ties_by_queued_time():
    conductor = make_conductor(2, policy="llumnix")
    conductor.observe(prefill_report("p0", queue_s=2.0), 0.0)
    assert place(conductor, {}).prefill_id == "p1"


@pytest.mark.parametrize("policy", ["random", "load_balance", "cache_aware", "kvcentric", "llumnix"])
def test_every_policy_reuses_no_more_than_the_prompt_minus_one_token(policy):
    decision = place(make_conductor(1, policy=policy), {"p0": 10}, n_tokens=1000)
    assert decision.cached_tokens == 999


def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="kvcentric"):
        from kvcentric.core.scheduling.policies import make_policy
        make_policy("fastest", None, None)


def test_kv_cache_hit_len_takes_the_longest_cached_prefix_however_busy_its_holder():
    """Llumnix's kvCacheHitLen: prefixHitTokens alone, higher is better; queued time only breaks ties."""
    conductor = make_conductor(3, policy="kv_cache_hit_len", rejection="never")
    conductor.observe(prefill_report("p0", queue_s=50.0), 0.0)
    conductor.observe(prefill_report("p2", queue_s=0.3), 0.0)
    assert place(conductor, {"p0": 8, "p1": 3}).prefill_id == "p0"
    assert place(conductor, {"p0": 2, "p2": 2}, request_id="tie").prefill_id == "p2"  # equal hits: p2's queue


def test_prompts_below_the_cache_aware_minimum_are_placed_by_load_alone():
    """Llumnix's --cache-aware-scheduling-min-tokens: a prompt shorter than it ignores its prefix hits."""
    conductor = make_conductor(2, policy="cache_aware", cache_aware_scheduling_min_tokens=1000)
    conductor.observe(prefill_report("p0", queue_s=0.5), 0.0)
    short = place(conductor, {"p0": 8}, n_tokens=999)
    assert short.prefill_id == "p1" and short.cached_tokens == 0
    long = place(conductor, {"p0": 8}, n_tokens=1000, request_id="long")
    assert long.prefill_id == "p0" and long.cached_tokens == 800


def test_expected_blocks_do_not_bring_back_the_prefix_of_a_prompt_below_the_minimum():
    """Blocks expected from an earlier placement (Mooncake §6.1) count as hits only where hits count at all."""
    conductor = make_conductor(2, policy="cache_aware", cache_aware_scheduling_min_tokens=1000, expect_cache=True)
    conductor.observe(prefill_report("p0", queue_s=0.5), 0.0)
    first = place(conductor, {"p1": 8}, n_tokens=1000, request_id="first")
    assert first.prefill_id == "p1"
    short = place(conductor, {}, n_tokens=999, request_id="short")  # p1 is expected to hold its blocks
    assert short.cached_tokens == 0
