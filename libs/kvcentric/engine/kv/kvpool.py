"""A node's host-memory KV block pool (Mooncake §3's DRAM KVCache pool): the bytes of its blocks in one
preallocated buffer, a block per slot of `core/host_slots.py`'s `HostSlots` (which slot holds which hash, the
reservations, pins and eviction: all its bookkeeping).

It stores and hands out block bytes; it does not move bytes between nodes (`kvcentric.runtime.transfer`) or
decide what to keep beyond its eviction policy. A block written behind the compute (`engine/kv/hostwrite.py`)
takes a slot with `reserve` and is written into its row of `rows`.
A block's bytes are [num_layers, 2 (key, value), block_size, num_kv_heads, head_dim] in C order, as it goes
in and out (`put`, `read`, pulls); inside, the pool keeps them block-major (a block's layers together) or
layer-major (`layers=N`: one layer of every block together, so that a layer-wise prefix load copies a contiguous
range of slots per layer instead of a slice of each block; `rows` gives both as the same strided view).
"""

from __future__ import annotations

import torch

from kvcentric.core.host_slots import HostSlots


class HostBlockPool(HostSlots):
    def __init__(self, capacity_blocks: int, block_bytes: int, policy: str = "lru", pin_memory: bool = False,
                 layers: int = 0) -> None:
        """`pin_memory`: page-locked (for a CUDA engine: its side stream copies into the pool asynchronously);
        `layers`: 0 keeps blocks block-major, N > 0 layer-major with N layers to a block."""
        if capacity_blocks < 1 or block_bytes < 1:
            raise ValueError("capacity_blocks and block_bytes must be positive")
        if layers < 0 or (layers and block_bytes % layers):
            raise ValueError(f"a block of {block_bytes} bytes does not split into {layers} layers")
        super().__init__(capacity_blocks, policy)
        self.block_bytes, self.layers = block_bytes, layers
        # Preallocated and touched once: no request pays for first-touch page faults.
        shape = (layers, capacity_blocks, block_bytes // layers) if layers else (capacity_blocks, block_bytes)
        self.buffer = torch.zeros(shape, dtype=torch.uint8, pin_memory=pin_memory)

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

    def view(self, block_hash: str, depth: int = 0) -> torch.Tensor:
        """The block's bytes in the pool (a view, strided in a layer-major pool: copy or pin before the pool can
        evict it)."""
        slot = self.touch(block_hash, depth)
        return self.rows(self.layers)[slot] if self.layers else self.buffer[slot]

    def read(self, block_hash: str, depth: int = 0) -> bytes | None:
        """A copy of the block's bytes, or None when it is not held."""
        if block_hash not in self.slot_of:
            return None
        return self.view(block_hash, depth).numpy().tobytes()
