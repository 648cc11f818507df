"""The conductor's local block index (`HolderIndex`) answers what kvs-meta's reply would, and kvs-meta's
dump regroups blocks into one BlockStored per holder."""

from __future__ import annotations

import random

import pytest

from kvcentric.runtime.kvs_store import dump_events
from kvcentric.core.protocol import BlockEvicted, BlockStored, KVSDump, decode, encode
from kvcentric.core.scheduling.prefix import HolderIndex, prefix_from_holders


def stored(node_id: str, block_hashes: list[str], tier: str = "dram") -> BlockStored:
    return BlockStored(node_id=node_id, block_hashes=block_hashes, tier=tier)


def evicted(node_id: str, block_hashes: list[str], tier: str = "dram") -> BlockEvicted:
    return BlockEvicted(node_id=node_id, block_hashes=block_hashes, tier=tier)


def test_a_block_counts_while_any_tier_of_the_node_holds_it():
    index = HolderIndex()
    index.apply([stored("p0", ["a", "b"], "device"), stored("p0", ["a", "b"], "dram")], now=0.0)
    index.apply([evicted("p0", ["a", "b"], "device")], now=0.0)
    assert index.match(["a", "b"]) == {"p0": 2}
    index.apply([evicted("p0", ["a"], "dram")], now=0.0)
    assert index.match(["a", "b"]) == {} and index.match(["b"]) == {"p0": 1}
    assert len(index) == 1 and index.nodes == 1 and index.events_applied == 4


def test_evicting_what_a_node_never_held_changes_nothing():
    index = HolderIndex()
    index.apply([evicted("p9", ["a"], "dram"), stored("p0", ["a"]), evicted("p0", ["a"], "device")],
                now=0.0)
    assert index.match(["a"]) == {"p0": 1}


def test_match_walks_each_node_to_its_first_missing_block():
    index = HolderIndex()
    index.apply([stored("p0", ["a", "b", "c"]), stored("p1", ["a", "c"], "device")], now=0.0)
    assert index.match(["a", "b", "c", "d"]) == {"p0": 3, "p1": 1}
    assert index.match([]) == {} and index.match(["c"]) == {"p0": 1, "p1": 1}


def test_a_purged_node_holds_nothing_and_may_come_back():
    index = HolderIndex()
    index.apply([stored("p0", ["a"], "device"), stored("p0", ["a"], "dram"), stored("p1", ["a"])],
                now=0.0)
    assert index.purge("p0") == 1 and index.match(["a"]) == {"p1": 1}
    index.apply([stored("p0", ["a"], "device")], now=1.0)
    assert index.match(["a"]) == {"p0": 1, "p1": 1}


def test_a_node_not_heard_from_for_the_lease_time_is_purged():
    index = HolderIndex(lease_ttl_s=5.0)
    index.apply([stored("quiet", ["a"]), stored("chatty", ["a"])], now=0.0)
    index.renew("chatty", 4.0)  # a load report
    index.renew("reporter", 4.0)  # a node that reports load but stores nothing
    assert index.expire(5.0) == [] and index.match(["a"]) == {"quiet": 1, "chatty": 1}
    assert index.expire(5.5) == ["quiet"] and index.match(["a"]) == {"chatty": 1}
    assert sorted(index.expire(9.5)) == ["chatty", "reporter"] and index.match(["a"]) == {} and len(index) == 0


def test_a_late_replayed_event_does_not_shorten_a_lease():
    index = HolderIndex(lease_ttl_s=5.0)
    index.renew("p0", 10.0)
    index.apply([stored("p0", ["a"])], now=2.0)  # buffered while seeding, applied with its arrival time
    assert index.expire(12.0) == [] and index.match(["a"]) == {"p0": 1}


@pytest.mark.parametrize("seed", range(30))
def test_random_event_sequences_match_what_kvs_meta_would_answer(seed):
    """A naive holder-set model of kvs-meta (hash -> {"node:tier"}), fed the same events and purges,
    read through `prefix_from_holders` as the conductor reads kvs-meta's reply."""
    rng = random.Random(seed)
    nodes, tiers, hashes = ["p0", "p1", "p2", "p3"], ["device", "dram"], [f"h{i}" for i in range(12)]
    index, reference = HolderIndex(), {h: set() for h in hashes}
    for _ in range(300):
        node, tier = rng.choice(nodes), rng.choice(tiers)
        blocks = rng.sample(hashes, rng.randint(1, 5))
        roll = rng.random()
        if roll < 0.03:
            index.purge(node)
            for holders in reference.values():
                holders -= {f"{node}:{t}" for t in tiers}
        elif roll < 0.6:
            index.apply([stored(node, blocks, tier)], now=0.0)
            for h in blocks:
                reference[h].add(f"{node}:{tier}")
        else:
            index.apply([evicted(node, blocks, tier)], now=0.0)
            for h in blocks:
                reference[h].discard(f"{node}:{tier}")
        query = rng.sample(hashes, rng.randint(0, 8)) if rng.random() < 0.5 else hashes[: rng.randint(0, 12)]
        assert index.match(query) == prefix_from_holders([sorted(reference[h]) for h in query])
    assert len(index) == sum(1 for holders in reference.values() if holders)


def test_the_dump_is_one_stored_event_per_holder():
    events = dump_events(["a", "b", "c", "d"], [["p0:device", "p0:dram"], ["p0:dram", "p1:dram"], [], ["p1:dram"]])
    assert events == [stored("p0", ["a"], "device"), stored("p0", ["a", "b"], "dram"),
                      stored("p1", ["b", "d"], "dram")]
    assert dump_events([], []) == [] and dump_events(["x"], [[]]) == []


def test_a_node_id_may_contain_a_colon_and_a_holder_without_one_is_skipped():
    assert dump_events(["a"], [["dc:p0:dram", "garbage"]]) == [stored("dc:p0", ["a"], "dram")]


def test_replaying_a_dump_rebuilds_the_same_index():
    source = HolderIndex()
    source.apply([stored("p0", ["a", "b"], "device"), stored("p1", ["a"], "dram"),
                  stored("p0", ["b"], "dram")], now=0.0)
    hashes = ["a", "b", "c"]
    holders = [sorted(f"{n}:dram" for n in source.match([h])) for h in hashes]
    page = decode(encode(KVSDump(events=dump_events(hashes, holders), cursor=0)), KVSDump)
    copy = HolderIndex()
    copy.apply(page.events, now=0.0)
    assert copy.match(["a", "b"]) == source.match(["a", "b"]) == {"p0": 2, "p1": 1}
