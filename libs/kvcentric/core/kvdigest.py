"""Digests of an engine's block sets and the events that turn an index's view of a node into what the node
holds: how the KV index heals after lost events (the engines are the truth, the index a copy). Pure: it
compares and computes, it asks nobody and stores nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

from kvcentric.core.protocol import BlockEvicted, BlockStored, KVEvent, TierDigest

EMPTY = TierDigest(count=0, xor=0)


def fingerprint(block_hash: str) -> int:
    """A 64-bit fingerprint of one block hash (any string)."""
    return int.from_bytes(hashlib.blake2b(block_hash.encode(), digest_size=8).digest(), "big")


def digest(block_hashes: Iterable[str]) -> TierDigest:
    """Count and XOR of the fingerprints of a set of distinct hashes; order does not matter."""
    count, xor = 0, 0
    for block_hash in block_hashes:
        count += 1
        xor ^= fingerprint(block_hash)
    return TierDigest(count=count, xor=xor)


def digests(tiers: Mapping[str, Iterable[str]]) -> dict[str, TierDigest]:
    return {tier: digest(hashes) for tier, hashes in tiers.items()}


def mismatched_tiers(held: Mapping[str, TierDigest], indexed: Mapping[str, TierDigest]) -> list[str]:
    """Tiers where the index's digest differs from the node's (a tier missing on one side counts as empty)."""
    return sorted(tier for tier in set(held) | set(indexed)
                  if held.get(tier, EMPTY) != indexed.get(tier, EMPTY))


def healing_events(node_id: str, held: Mapping[str, Iterable[str]],
                   indexed: Mapping[str, Iterable[str]]) -> list[KVEvent]:
    """The events that make the index's blocks of `node_id` (tier -> hashes) equal to what it holds: per
    tier, the blocks the index lacks as BlockStored and the ones it has but the node does not as
    BlockEvicted (hashes sorted, so the result does not depend on set order)."""
    events: list[KVEvent] = []
    for tier in sorted(set(held) | set(indexed)):
        have, known = set(held.get(tier, ())), set(indexed.get(tier, ()))
        if gone := sorted(known - have):
            events.append(BlockEvicted(node_id=node_id, block_hashes=gone, tier=tier))
        if missing := sorted(have - known):
            events.append(BlockStored(node_id=node_id, block_hashes=missing, tier=tier))
    return events


def healed_blocks(events: Iterable[KVEvent]) -> int:
    return sum(len(event.block_hashes) for event in events)
