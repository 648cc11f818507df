"""Eviction policies for a pool of prefix KV blocks (LRU, LFU, length-aware) and the bounded block cache
that uses them; pure bookkeeping of block keys, it stores no KV bytes.

Mooncake §3 and Table 1: the host-memory KVCache pool evicts by LRU, LFU, or "LengthAwareCache
(similar to LFU but prioritizing cache blocks occurring later in requests)". We read "prioritizing"
as *for eviction*: among blocks used equally often, the one deeper in its request goes first, because a
prefix cache can only use a block when every block before it is also there. A block's depth is its
index in the request's block list (a prefix hash always sits at the same depth).

Each policy is one class with the verbs on_insert / on_access / on_remove / evict_candidate, so the
messenger's host pool can reuse them; `BlockCache` adds the capacity and the prefix lookups.
"""

from __future__ import annotations

import collections
import heapq
import math
from typing import Literal, Protocol, get_args
from collections.abc import Hashable, Iterable, Sequence

Key = Hashable

EvictionName = Literal["lru", "lfu", "length_aware"]
"""The eviction policies, by the name the flags take (`--eviction`, `--host-pool-policy`)."""
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionName)


class EvictionPolicy(Protocol):
    name: str

    def on_insert(self, key: Key, depth: int) -> None:
        """`key` entered the pool."""

    def on_access(self, key: Key, depth: int) -> None:
        """`key`, already in the pool, was used again."""

    def on_remove(self, key: Key) -> None:
        """`key` left the pool (evicted or dropped)."""

    def evict_candidate(self) -> Key | None:
        """The key to evict next (not removed by this call); None when the policy tracks no key."""


class LRUPolicy:
    """Least recently used goes first."""

    name = "lru"

    def __init__(self) -> None:
        self.order: collections.OrderedDict[Key, None] = collections.OrderedDict()

    def on_insert(self, key: Key, depth: int) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def on_access(self, key: Key, depth: int) -> None:
        self.order.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        self.order.pop(key, None)

    def evict_candidate(self) -> Key | None:
        return next(iter(self.order), None)


class LFUPolicy:
    """Least frequently used (uses while in the pool) goes first; ties go least recently used first."""

    name = "lfu"

    def __init__(self) -> None:
        self.count: dict[Key, int] = {}
        self.buckets: dict[int, collections.OrderedDict[Key, None]] = collections.defaultdict(
            collections.OrderedDict)
        self.min_count = 0

    def on_insert(self, key: Key, depth: int) -> None:
        self.count[key] = 1
        self.buckets[1][key] = None
        self.min_count = 1

    def on_access(self, key: Key, depth: int) -> None:
        count = self.count[key]
        self._unlink(key, count)
        self.count[key] = count + 1
        self.buckets[count + 1][key] = None

    def on_remove(self, key: Key) -> None:
        count = self.count.pop(key, None)
        if count is not None:
            self._unlink(key, count)

    def _unlink(self, key: Key, count: int) -> None:
        bucket = self.buckets[count]
        del bucket[key]
        if not bucket:
            del self.buckets[count]
            if count == self.min_count:
                self.min_count = min(self.buckets, default=0)

    def evict_candidate(self) -> Key | None:
        if not self.count:
            return None
        return next(iter(self.buckets[self.min_count]))


class LengthAwarePolicy:
    """LFU order, but among equally used blocks the deepest (latest in its request) goes first, then LRU."""

    name = "length_aware"

    def __init__(self) -> None:
        self.state: dict[Key, tuple[int, int, int]] = {}
        """key -> (uses, depth, last-use tick); the heap holds (uses, -depth, tick, key), stale ones lazily."""
        self.heap: list[tuple[int, int, int, Key]] = []
        self.tick = 0

    def _push(self, key: Key, uses: int, depth: int) -> None:
        self.tick += 1
        self.state[key] = (uses, depth, self.tick)
        heapq.heappush(self.heap, (uses, -depth, self.tick, key))
        if len(self.heap) > 4 * len(self.state) + 64:
            self.heap = [(u, -d, t, k) for k, (u, d, t) in self.state.items()]
            heapq.heapify(self.heap)

    def on_insert(self, key: Key, depth: int) -> None:
        self._push(key, 1, depth)

    def on_access(self, key: Key, depth: int) -> None:
        uses, depth, _ = self.state[key]
        self._push(key, uses + 1, depth)

    def on_remove(self, key: Key) -> None:
        self.state.pop(key, None)

    def evict_candidate(self) -> Key | None:
        heap, state = self.heap, self.state
        while heap:
            uses, negative_depth, tick, key = heap[0]
            if state.get(key, (0, 0, -1))[2] == tick:
                return key
            heapq.heappop(heap)
        return None


POLICIES = {policy.name: policy for policy in (LRUPolicy, LFUPolicy, LengthAwarePolicy)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose {', '.join(EVICTION_POLICIES)}") from None


def parse_capacity(text: str | int | float) -> float:
    """A capacity in blocks: a positive integer, or "inf" for unbounded."""
    value = float(text)
    if value != math.inf and (value < 1 or value != int(value)):
        raise ValueError(f"capacity must be a positive integer or inf, got {text!r}")
    return value


class BlockCache:
    """A pool of at most `capacity` block keys, evicting by `policy`. Keys are prefix hashes."""

    def __init__(self, capacity: float, policy: str | EvictionPolicy = "lru") -> None:
        if capacity < 1:
            raise ValueError("a block cache holds at least one block")
        self.capacity = capacity
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.keys: set[Key] = set()

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: Key) -> bool:
        return key in self.keys

    def prefix_len(self, keys: Sequence[Key]) -> int:
        """How many leading `keys` are all in the pool (a lookup; nothing is touched)."""
        held = self.keys
        for i, key in enumerate(keys):
            if key not in held:
                return i
        return len(keys)

    def hits(self, keys: Iterable[Key]) -> int:
        """How many of `keys` are in the pool, wherever they sit."""
        held = self.keys
        return sum(1 for key in keys if key in held)

    def touch(self, keys: Sequence[Key]) -> None:
        """Record a use of the keys that are in the pool (depth = position in `keys`)."""
        for depth, key in enumerate(keys):
            if key in self.keys:
                self.policy.on_access(key, depth)

    def insert(self, keys: Sequence[Key]) -> list[Key]:
        """Use `keys` as one request's blocks: touch those present, add the rest, evict down to
        capacity. Returns the evicted keys (possibly some of `keys` when they exceed the capacity)."""
        held, policy = self.keys, self.policy
        for depth, key in enumerate(keys):
            if key in held:
                policy.on_access(key, depth)
            else:
                held.add(key)
                policy.on_insert(key, depth)
        evicted = []
        while len(held) > self.capacity:
            victim = policy.evict_candidate()
            policy.on_remove(victim)
            held.discard(victim)
            evicted.append(victim)
        return evicted

    def remove(self, keys: Iterable[Key]) -> None:
        for key in keys:
            if key in self.keys:
                self.keys.discard(key)
                self.policy.on_remove(key)
