"""A node's host-memory KV block pool (Mooncake §3's DRAM KVCache pool): the bytes of its blocks in one
preallocated buffer, a block per slot of `core/host_slots.py`'s `HostSlots` (which slot holds which hash, the
reservations, pins and eviction: all its bookkeeping).

It stores and hands out block bytes; it does not move bytes between nodes (`kvcentric.runtime.transfer`) or
decide what to keep beyond its eviction policy. A block written behind the compute (`engine/kv/hostwrite.py`)
takes a slot with `reserve` and is written into `buffer[slot]`.
A block's bytes are [num_layers, 2 (key, value), block_size, num_kv_heads, head_dim] in C order.
"""

from __future__ import annotations

import torch

from kvcentric.core.host_slots import HostSlots


class HostBlockPool(HostSlots):
    def __init__(self, capacity_blocks: int, block_bytes: int, policy: str = "lru", pin_memory: bool = False) -> None:
        """`pin_memory`: page-locked (for a CUDA engine: its side stream copies into the pool asynchronously)."""
        if capacity_blocks < 1 or block_bytes < 1:
            raise ValueError("capacity_blocks and block_bytes must be positive")
        super().__init__(capacity_blocks, policy)
        self.block_bytes = block_bytes
        # Preallocated and touched once: no request pays for first-touch page faults.
        self.buffer = torch.zeros((capacity_blocks, block_bytes), dtype=torch.uint8, pin_memory=pin_memory)

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
        self.buffer[slot].copy_(flat)
        self._index(slot, block_hash, depth)
        return True

    def view(self, block_hash: str, depth: int = 0) -> torch.Tensor:
        """The block's bytes in the pool (a view: copy or pin before the pool can evict it)."""
        return self.buffer[self.touch(block_hash, depth)]

    def read(self, block_hash: str, depth: int = 0) -> bytes | None:
        """A copy of the block's bytes, or None when it is not held."""
        if block_hash not in self.slot_of:
            return None
        return self.view(block_hash, depth).numpy().tobytes()
