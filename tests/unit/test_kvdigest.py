"""The digests of block sets and the events that heal an index's view of a node (kvcentric.core.kvdigest)."""

from kvcentric.core.kvdigest import EMPTY, digest, digests, healed_blocks, healing_events, mismatched_tiers
from kvcentric.core.protocol import BlockEvicted, BlockStored, KVDigest, TierDigest, decode, encode


def test_equal_sets_have_equal_digests_whatever_their_order():
    assert digest(["a", "b", "c"]) == digest(["c", "a", "b"]) == digest({"b", "c", "a"})
    assert digest([]) == EMPTY == TierDigest(count=0, xor=0)


def test_a_missing_extra_or_swapped_block_changes_the_digest():
    held = digest(["a", "b", "c"])
    assert digest(["a", "b"]) != held  # one missing
    assert digest(["a", "b", "c", "d"]) != held  # one extra
    assert digest(["a", "b", "x"]) != held  # same count, another block


def test_the_digest_survives_the_wire_with_its_64_bit_fingerprints():
    message = KVDigest(node_id="p0", tiers=digests({"device": [f"h{i}" for i in range(1000)], "dram": []}))
    assert decode(encode(message), KVDigest) == message
    assert 0 <= message.tiers["device"].xor < 2 ** 64


def test_only_the_tiers_that_differ_mismatch_and_a_missing_tier_counts_as_empty():
    held = digests({"device": ["a", "b"], "dram": ["c"]})
    assert mismatched_tiers(held, digests({"device": ["b", "a"], "dram": ["c"]})) == []
    assert mismatched_tiers(held, digests({"device": ["a", "b"]})) == ["dram"]
    assert mismatched_tiers(digests({"device": ["a"], "dram": []}), digests({"device": ["a"]})) == []
    assert mismatched_tiers({}, digests({"device": ["a"]})) == ["device"]  # the index holds what the node lost


def test_healing_events_store_what_the_index_lacks_and_evict_what_the_node_no_longer_holds():
    events = healing_events("p0", {"device": ["a", "b", "c"], "dram": ["d"]},
                            {"device": {"b", "x"}, "dram": {"d"}, "ssd": {"y"}})
    assert events == [BlockEvicted(node_id="p0", block_hashes=["x"], tier="device"),
                      BlockStored(node_id="p0", block_hashes=["a", "c"], tier="device"),
                      BlockEvicted(node_id="p0", block_hashes=["y"], tier="ssd")]
    assert healed_blocks(events) == 4


def test_an_index_that_matches_needs_no_healing_and_an_empty_index_gets_everything():
    assert healing_events("p0", {"device": ["a", "b"]}, {"device": {"a", "b"}}) == []
    assert healing_events("p0", {"dram": ["b", "a"]}, {}) == [BlockStored(node_id="p0", block_hashes=["a", "b"],
                                                                          tier="dram")]


def test_applying_the_healing_events_makes_the_digests_equal():
    held = {"device": [f"h{i}" for i in range(0, 300, 2)], "dram": [f"h{i}" for i in range(50)]}
    indexed = {"device": {f"h{i}" for i in range(0, 300, 3)}, "dram": set()}
    for event in healing_events("p0", held, indexed):
        blocks = indexed.setdefault(event.tier, set())
        if isinstance(event, BlockStored):
            blocks.update(event.block_hashes)
        else:
            blocks.difference_update(event.block_hashes)
    assert mismatched_tiers(digests(held), digests(indexed)) == [] and indexed["device"] == set(held["device"])
