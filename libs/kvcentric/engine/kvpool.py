"""A node's host-memory KV block pool (Mooncake §3's DRAM KVCache pool): a preallocated buffer of
fixed-size blocks indexed by prefix hash, evicting by the same policy classes the simulator uses
(`lru`, `lfu`, `length_aware`), never holding more than its capacity.

It stores and hands out block bytes and reports what entered and left; it does not move bytes between
nodes (`kvcentric.runtime.transfer`) or decide what to keep beyond its eviction policy. A block written
behind the compute (`engine/hostwrite.py`) takes a slot with `reserve`, which is neither found nor
announced nor evicted until `commit` says its bytes are there (`release` gives the slot back).
A block's bytes are [num_layers, 2 (key, value), block_size, num_kv_heads, head_dim] in C order, as it goes
in and out (`put`, `read`, pulls); inside, the pool keeps them block-major (a block's layers together) or
layer-major (`layers=N`: one layer of every block together, so that a layer-wise prefix load copies a contiguous
range of slots per layer instead of a slice of each block; `rows` gives both as the same strided view).
"""

from __future__ import annotations

from typing import cast

import torch

from kvcentric.core.scheduling.eviction import make_policy


class HostBlockPool:
    def __init__(self, capacity_blocks: int, block_bytes: int, policy: str = "lru", pin_memory: bool = False,
                 layers: int = 0) -> None:
        """`pin_memory`: page-locked (for a CUDA engine: its side stream copies into the pool asynchronously);
        `layers`: 0 keeps blocks block-major, N > 0 layer-major with N layers to a block."""
        if capacity_blocks < 1 or block_bytes < 1:
            raise ValueError("capacity_blocks and block_bytes must be positive")
        if layers < 0 or (layers and block_bytes % layers):
            raise ValueError(f"a block of {block_bytes} bytes does not split into {layers} layers")
        self.capacity, self.block_bytes, self.layers = capacity_blocks, block_bytes, layers
        self.policy = make_policy(policy)
        # Preallocated and touched once: no request pays for first-touch page faults.
        shape = (layers, capacity_blocks, block_bytes // layers) if layers else (capacity_blocks, block_bytes)
        self.buffer = torch.zeros(shape, dtype=torch.uint8, pin_memory=pin_memory)
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

    def put(self, block_hash: str, depth: int, data: torch.Tensor | bytes | memoryview) -> bool:
        """Store one block (`depth`: its index in its request); False when every slot is pinned."""
        if block_hash in self.slot_of or block_hash in self._reserved_hashes:
            if block_hash in self.slot_of:
                self.policy.on_access(block_hash, depth)
            return True
        slot = self._free_slot()
        if slot is None:
            return False
        flat = data.reshape(-1).view(torch.uint8) if isinstance(data, torch.Tensor) else \
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if flat.numel() != self.block_bytes:
            self.free_slots.append(slot)
            raise ValueError(f"a block is {self.block_bytes} bytes, got {flat.numel()}")
        self.rows(self.layers or 1)[slot].copy_(flat.view(self.layers or 1, -1))
        self._index(slot, block_hash, depth)
        return True

    @property
    def layer_major(self) -> bool:
        return self.layers > 0

    def rows(self, num_layers: int) -> torch.Tensor:
        """The pool as [capacity, num_layers, layer bytes] (uint8, a view in either layout): row `slot` is that
        slot's block, its layer `l` at [slot, l]."""
        if not self.layers:
            return self.buffer.view(self.capacity, num_layers, -1)
        if num_layers != self.layers:
            raise ValueError(f"this pool's blocks have {self.layers} layers, not {num_layers}")
        return self.buffer.permute(1, 0, 2)

    def wanted(self, block_hash: str) -> bool:
        """Neither held nor being written."""
        return block_hash not in self.slot_of and block_hash not in self._reserved_hashes

    def reserve(self, block_hash: str, depth: int) -> int | None:
        """A slot for a block about to be written into `buffer[slot]`, evicting if need be; None when every
        slot is pinned or reserved. Until `commit`, the block is neither found nor announced."""
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

    def _index(self, slot: int, block_hash: str, depth: int) -> None:
        self.slot_of[block_hash], self.hash_of[slot] = slot, block_hash
        self.policy.on_insert(block_hash, depth)
        self._stored.append(block_hash)
        self.stats["host_blocks_stored"] += 1

    def view(self, block_hash: str, depth: int = 0) -> torch.Tensor:
        """The block's bytes in the pool (a view, strided in a layer-major pool: copy or pin before the pool can
        evict it)."""
        slot = self.slot_of[block_hash]
        self.policy.on_access(block_hash, depth)
        self.stats["host_blocks_read"] += 1
        return self.rows(self.layers)[slot] if self.layers else self.buffer[slot]

    def read(self, block_hash: str, depth: int = 0) -> bytes | None:
        """A copy of the block's bytes, or None when it is not held."""
        if block_hash not in self.slot_of:
            return None
        return self.view(block_hash, depth).numpy().tobytes()

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
