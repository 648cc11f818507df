"""Prefix matching: for a request's chained block hashes, how many leading blocks each instance holds.

Mooncake Algorithm 1 lines 4-6 (FindBestPrefixMatch, instance.prefix_len) and Llumnix's "longest
contiguous prefix hit length" per instance. `PrefixIndex` is an in-memory block -> holders index (the
simulator's, and the benchmark's stand-in for kvs-meta); `prefix_from_holders` reads a kvs-meta batch
reply; `HolderIndex` is the conductor's local mirror of kvs-meta, kept from the same KV events and leases
(Mooncake §4.2's KVCache metadata, read without a network hop). It matches; it does not decide placement,
does no I/O and reads no clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

from kvcentric.core.protocol import BlockEvicted, BlockStored, KVEvent


def prefix_from_holders(holders: Sequence[Iterable[str]]) -> dict[str, int]:
    """Leading blocks held per node, from kvs-meta's per-hash holders ("node_id:tier" strings).

    A node counts a block whatever the tier. Nodes holding no leading block are absent.
    """
    result: dict[str, int] = {}
    alive: set[str] | None = None
    for depth, found in enumerate(holders):
        nodes = {holder.rsplit(":", 1)[0] for holder in found}
        current = nodes if alive is None else alive & nodes
        for node in (alive or set()) - current:
            result[node] = depth
        alive = current
        if not alive:
            return result
    for node in alive or ():
        result[node] = len(holders)
    return result


class PrefixIndex:
    """Block key -> bitmask of the instances that hold it; `match` walks a request's keys once."""

    def __init__(self) -> None:
        self.holders: dict[Hashable, int] = {}
        self.slot_of: dict[str, int] = {}
        self.ids: list[str] = []

    def slot(self, instance_id: str) -> int:
        slot = self.slot_of.get(instance_id)
        if slot is None:
            slot = self.slot_of[instance_id] = len(self.ids)
            self.ids.append(instance_id)
        return slot

    def add(self, instance_id: str, keys: Iterable[Hashable]) -> None:
        bit, holders = 1 << self.slot(instance_id), self.holders
        for key in keys:
            holders[key] = holders.get(key, 0) | bit

    def remove(self, instance_id: str, keys: Iterable[Hashable]) -> None:
        clear, holders = ~(1 << self.slot(instance_id)), self.holders
        for key in keys:
            mask = holders.get(key, 0) & clear
            if mask:
                holders[key] = mask
            else:
                holders.pop(key, None)

    def match(self, keys: Sequence[Hashable]) -> dict[str, int]:
        """Leading blocks of `keys` held per instance (instances holding none are absent)."""
        holders, ids, result = self.holders, self.ids, {}
        alive = holders.get(keys[0], 0) if keys else 0
        depth = 1
        while alive and depth < len(keys):
            current = alive & holders.get(keys[depth], 0)
            dropped = alive & ~current
            while dropped:
                low = dropped & -dropped
                result[ids[low.bit_length() - 1]] = depth
                dropped ^= low
            alive, depth = current, depth + 1
        while alive:
            low = alive & -alive
            result[ids[low.bit_length() - 1]] = depth
            alive ^= low
        return result


class HolderIndex:
    """Block hash -> holding nodes, from BlockStored / BlockEvicted events, with kvs-meta's semantics.

    A node holds a block while it holds it in any tier. Every event and every load report of a node
    renews its lease; `expire` purges nodes not heard from for `lease_ttl_s` (kvs-meta's --lease-ttl-s).
    `match` answers what `prefix_from_holders` answers for kvs-meta's reply to the same hashes.
    """

    def __init__(self, lease_ttl_s: float = 5.0) -> None:
        self.lease_ttl_s = lease_ttl_s
        self.prefix = PrefixIndex()
        self.tiers: dict[str, dict[str, int]] = {}
        """node -> block hash -> bitmask of the tiers it holds the block in."""
        self.tier_bits: dict[str, int] = {}
        self.heard: dict[str, float] = {}
        """node -> when it last sent an event or a load report."""
        self.events_applied = 0

    def __len__(self) -> int:
        """Blocks held by at least one node."""
        return len(self.prefix.holders)

    @property
    def nodes(self) -> int:
        """Nodes holding at least one block."""
        return sum(1 for blocks in self.tiers.values() if blocks)

    def apply(self, events: Iterable[KVEvent], now: float) -> None:
        for event in events:
            self.renew(event.node_id, now)
            if isinstance(event, BlockStored):
                self.store(event.node_id, event.tier, event.block_hashes)
            elif isinstance(event, BlockEvicted):
                self.evict(event.node_id, event.tier, event.block_hashes)
            self.events_applied += 1

    def store(self, node_id: str, tier: str, block_hashes: Iterable[str]) -> None:
        bit, blocks, new = self._tier_bit(tier), self.tiers.setdefault(node_id, {}), []
        for block_hash in block_hashes:
            mask = blocks.get(block_hash, 0)
            if not mask:
                new.append(block_hash)
            blocks[block_hash] = mask | bit
        self.prefix.add(node_id, new)

    def evict(self, node_id: str, tier: str, block_hashes: Iterable[str]) -> None:
        blocks = self.tiers.get(node_id)
        if not blocks:
            return
        clear, gone = ~self._tier_bit(tier), []
        for block_hash in block_hashes:
            mask = blocks.get(block_hash, 0) & clear
            if mask:
                blocks[block_hash] = mask
            elif blocks.pop(block_hash, None) is not None:
                gone.append(block_hash)
        self.prefix.remove(node_id, gone)

    def renew(self, node_id: str, now: float) -> None:
        """A sign of life from the node (an event or a load report): its lease runs `lease_ttl_s` more."""
        self.heard[node_id] = max(now, self.heard.get(node_id, now))

    def purge(self, node_id: str) -> int:
        """Forget the node and every block it held; returns how many it held."""
        self.heard.pop(node_id, None)
        blocks = self.tiers.pop(node_id, {})
        self.prefix.remove(node_id, blocks)
        return len(blocks)

    def expire(self, now: float) -> list[str]:
        """Purge the nodes whose lease ran out; returns them."""
        expired = [node for node, heard in self.heard.items() if now - heard > self.lease_ttl_s]
        for node_id in expired:
            self.purge(node_id)
        return expired

    def match(self, block_hashes: Sequence[str]) -> dict[str, int]:
        """Leading blocks of `block_hashes` held per node (nodes holding none are absent)."""
        return self.prefix.match(block_hashes)

    def _tier_bit(self, tier: str) -> int:
        bit = self.tier_bits.get(tier)
        if bit is None:
            bit = self.tier_bits[tier] = 1 << len(self.tier_bits)
        return bit


class ExpectedBlocks:
    """The blocks the Conductor expects an instance to hold once the prefills it placed there are done, until
    the KV events say so (Mooncake §6.1: on assigning a request, the Conductor "updates the cache ... for that
    instance accordingly"). A request placed right behind another with the same prefix then finds it on the
    same instance instead of computing it elsewhere. Each expectation lapses at the time given to `expect`
    (the blocks were announced by then, or they never will be). It matches; it reads no clock.
    """

    def __init__(self) -> None:
        self.prefix = PrefixIndex()
        self.count: dict[tuple[str, Hashable], int] = {}
        """(instance, block) -> expectations that name it."""
        self.until: list[tuple[float, str, Sequence[Hashable]]] = []
        """(lapses at, instance, blocks), oldest first."""

    def __len__(self) -> int:
        return len(self.until)

    def expect(self, instance_id: str, block_hashes: Sequence[Hashable], until: float) -> None:
        new = []
        for block_hash in block_hashes:
            key = (instance_id, block_hash)
            held = self.count.get(key, 0)
            self.count[key] = held + 1
            if not held:
                new.append(block_hash)
        self.prefix.add(instance_id, new)
        self.until.append((until, instance_id, block_hashes))
        if len(self.until) > 1 and self.until[-2][0] > until:
            self.until.sort(key=lambda entry: entry[0])

    def expire(self, now: float) -> None:
        """Forget the expectations that lapsed before `now`."""
        lapsed = 0
        while lapsed < len(self.until) and self.until[lapsed][0] <= now:
            _, instance_id, block_hashes = self.until[lapsed]
            gone = []
            for block_hash in block_hashes:
                key = (instance_id, block_hash)
                left = self.count[key] - 1
                if left:
                    self.count[key] = left
                else:
                    del self.count[key]
                    gone.append(block_hash)
            self.prefix.remove(instance_id, gone)
            lapsed += 1
        del self.until[:lapsed]

    def match(self, block_hashes: Sequence[Hashable]) -> dict[str, int]:
        """Leading blocks of `block_hashes` each instance is expected to hold (instances expected to hold none
        are absent)."""
        if not self.until or not block_hashes:
            return {}
        return self.prefix.match(block_hashes)

    def merged(self, block_hashes: Sequence[Hashable], hits: Mapping[str, int]) -> dict[str, int]:
        """`hits` (leading blocks each instance holds) with what each is expected to hold: the longer of the two
        (every expectation is a whole prompt's chain from its first block, so the longer one is the prefix)."""
        merged = dict(hits)
        for instance_id, depth in self.match(block_hashes).items():
            if depth > merged.get(instance_id, 0):
                merged[instance_id] = depth
        return merged
