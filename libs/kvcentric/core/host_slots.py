"""The bookkeeping of a node's host-memory KV block pool (Mooncake §3's DRAM KVCache pool): which slot holds which
block hash, the slots reserved for blocks being written, the pins of blocks in use by a transfer, and eviction by
the same policy classes the simulator uses (`lru`, `lfu`, `length_aware`), never more blocks than its capacity.

Plain Python, no torch and no I/O: it holds no bytes (`engine/kv/kvpool.py`'s `HostBlockPool` keeps them in the
slots it hands out) and publishes nothing (callers read `drain_events()`). A block written behind the compute
takes a slot with `reserve`, which is neither found nor announced nor evicted until `commit` says its bytes are
there (`release` gives the slot back).
"""

from __future__ import annotations

from typing import cast

from kvcentric.core.scheduling.eviction import make_policy


class HostSlots:
    def __init__(self, capacity_blocks: int, policy: str = "lru") -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be positive")
        self.capacity = capacity_blocks
        self.policy = make_policy(policy)
        self.slot_of: dict[str, int] = {}
        self.hash_of: dict[int, str] = {}
        self.reserved: dict[int, tuple[str, int]] = {}
        """Slot -> (hash, depth) of blocks being written: not found, not announced, not evicted."""
        self._reserved_hashes: set[str] = set()
        self.free_slots = list(range(capacity_blocks - 1, -1, -1))
        self.pins: dict[str, int] = {}
        self._stored: list[str] = []
        self._evicted: list[str] = []
        self.stats = {"host_blocks_stored": 0, "host_blocks_evicted": 0, "host_blocks_read": 0}

    def __len__(self) -> int:
        return len(self.slot_of)

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self.slot_of

    def prefix(self, hashes: list[str]) -> int:
        """How many leading hashes are held."""
        count = 0
        while count < len(hashes) and hashes[count] in self.slot_of:
            count += 1
        return count

    def wanted(self, block_hash: str) -> bool:
        """Neither held nor being written."""
        return block_hash not in self.slot_of and block_hash not in self._reserved_hashes

    def reserve(self, block_hash: str, depth: int) -> int | None:
        """A slot for a block about to be written into it, evicting if need be; None when every slot is pinned
        or reserved. Until `commit`, the block is neither found nor announced."""
        if not self.wanted(block_hash):
            raise ValueError(f"block {block_hash} is held or being written already")
        slot = self._free_slot()
        if slot is not None:
            self.reserved[slot] = (block_hash, depth)
            self._reserved_hashes.add(block_hash)
        return slot

    def commit(self, slot: int) -> None:
        """The reserved slot's bytes are there: the block is found and announced from now on."""
        block_hash, depth = self.reserved.pop(slot)
        self._reserved_hashes.discard(block_hash)
        self._index(slot, block_hash, depth)

    def release(self, slot: int) -> None:
        """Give a reserved slot back unwritten (its copy failed)."""
        block_hash, _ = self.reserved.pop(slot)
        self._reserved_hashes.discard(block_hash)
        self.free_slots.append(slot)

    def touch(self, block_hash: str, depth: int = 0) -> int:
        """A held block read: its slot, the read counted and the eviction policy told."""
        slot = self.slot_of[block_hash]
        self.policy.on_access(block_hash, depth)
        self.stats["host_blocks_read"] += 1
        return slot

    def pin(self, block_hash: str) -> None:
        self.pins[block_hash] = self.pins.get(block_hash, 0) + 1

    def unpin(self, block_hash: str) -> None:
        if self.pins.get(block_hash, 0) <= 1:
            self.pins.pop(block_hash, None)
        else:
            self.pins[block_hash] -= 1

    def drain_events(self) -> tuple[list[str], list[str]]:
        """Hashes stored and evicted since the last call."""
        stored, evicted = self._stored, self._evicted
        self._stored, self._evicted = [], []
        return stored, evicted

    def _index(self, slot: int, block_hash: str, depth: int) -> None:
        self.slot_of[block_hash], self.hash_of[slot] = slot, block_hash
        self.policy.on_insert(block_hash, depth)
        self._stored.append(block_hash)
        self.stats["host_blocks_stored"] += 1

    def _free_slot(self) -> int | None:
        if self.free_slots:
            return self.free_slots.pop()
        skipped = []
        try:
            while (victim := self.policy.evict_candidate()) is not None:
                if victim in self.pins:  # in use by a transfer: step over it for now
                    self.policy.on_remove(victim)
                    skipped.append(victim)
                    continue
                return self._evict(cast(str, victim))  # the policy holds the block hashes put here
            return None
        finally:
            for key in skipped:
                self.policy.on_insert(key, 0)

    def _evict(self, block_hash: str) -> int:
        slot = self.slot_of.pop(block_hash)
        del self.hash_of[slot]
        self.policy.on_remove(block_hash)
        self._evicted.append(block_hash)
        self.stats["host_blocks_evicted"] += 1
        return slot
