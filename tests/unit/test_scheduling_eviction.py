"""Eviction policies and the bounded block cache (Mooncake Table 1's LRU, LFU and length-aware)."""

import math

import pytest

from kvcentric.core.scheduling.eviction import BlockCache, LengthAwarePolicy, make_policy, parse_capacity
from kvcentric.core.sim.cachesim import replay_pool
from kvcentric.core.sim.workload import SimRequest


def test_lru_evicts_the_least_recently_used():
    cache = BlockCache(3, "lru")
    cache.insert(["a", "b", "c"])
    cache.touch(["a"])
    assert cache.insert(["d"]) == ["b"]
    assert set(cache.keys) == {"a", "c", "d"}


def test_lfu_evicts_the_least_used_then_the_oldest():
    cache = BlockCache(3, "lfu")
    cache.insert(["a", "b", "c"])
    cache.insert(["a", "b"])
    assert cache.insert(["d"]) == ["c"]
    assert cache.insert(["e"]) == ["d"]  # d (1 use) goes before a, b (2 uses)


def test_length_aware_evicts_deeper_blocks_first_among_equally_used():
    cache = BlockCache(3, "length_aware")
    cache.insert(["a", "b", "c"])  # depths 0, 1, 2
    assert cache.insert(["x"]) == ["c"]
    cache.insert(["a", "b"])
    assert cache.insert(["y"]) == ["x"]  # x and y: 1 use, depth 0; x older


def test_policies_track_removals_and_report_nothing_when_empty():
    for name in ("lru", "lfu", "length_aware"):
        policy = make_policy(name)
        assert policy.evict_candidate() is None
        policy.on_insert("a", 0)
        policy.on_insert("b", 1)
        policy.on_remove(policy.evict_candidate())
        assert policy.evict_candidate() is not None
        policy.on_remove("a")
        policy.on_remove("b")
        assert policy.evict_candidate() is None


def test_length_aware_heap_stays_bounded_under_repeated_access():
    policy = LengthAwarePolicy()
    policy.on_insert("a", 0)
    for _ in range(1000):
        policy.on_access("a", 0)
    assert len(policy.heap) < 100 and policy.evict_candidate() == "a"


def test_block_cache_prefix_and_hits():
    cache = BlockCache(math.inf, "lru")
    cache.insert(["a", "b", "d"])
    assert cache.prefix_len(["a", "b", "c", "d"]) == 2 and cache.hits(["a", "b", "c", "d"]) == 3
    cache.remove(["b"])
    assert cache.prefix_len(["a", "b"]) == 1 and len(cache) == 2


def test_a_request_larger_than_the_cache_keeps_its_last_blocks():
    cache = BlockCache(2, "lru")
    assert cache.insert(["a", "b", "c"]) == ["a"]


def test_capacity_parsing():
    assert parse_capacity("inf") == math.inf and parse_capacity("1000") == 1000
    for bad in ("0", "1.5", "-3"):
        with pytest.raises(ValueError, match="capacity"):
            parse_capacity(bad)
    with pytest.raises(ValueError, match="lru"):
        make_policy("fifo")


def test_global_pool_replay_counts_hits_and_prefix_hits_in_arrival_order():
    requests = [SimRequest("a", 0, 1024, 1, ["1", "2"]), SimRequest("b", 1, 1536, 1, ["1", "3", "2"]),
                SimRequest("c", 2, 1024, 1, ["1", "2"])]
    result = replay_pool(requests, "lru", math.inf)
    assert result["blocks"] == 7
    assert result["hit_ratio"] == pytest.approx(4 / 7)  # b: 1 and 2; c: 1 and 2
    assert result["prefix_hit_ratio"] == pytest.approx(3 / 7)  # b stops at 3
    assert replay_pool(requests, "lru", 1)["hit_ratio"] == pytest.approx(2 / 7)  # only "2" survives each request
