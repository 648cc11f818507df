"""Prefix matching: for a request's chained block hashes, how many leading blocks each instance holds.

Mooncake Algorithm 1 lines 4-6 (FindBestPrefixMatch, instance.prefix_len) and Llumnix's "longest
contiguous prefix hit length" per instance. `PrefixIndex` is an in-memory block -> holders index (the
simulator's, and the benchmark's stand-in for kvs-meta); `prefix_from_holders` reads a kvs-meta batch
reply. It matches; it does not decide placement and does not talk to kvs-meta.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Sequence


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
