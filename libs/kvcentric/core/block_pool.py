"""Bookkeeping of a paged KV cache: free blocks, explicit ref counts, and a prefix cache by block hash.

Plain Python, no torch and no I/O. A block is free when its ref count is zero; a free block that still
holds a hashed full block stays findable by its hash until it is reused (least recently freed first),
at which point its hash is reported as evicted. Callers read `drain_events()` to publish
BlockStored / BlockEvicted to the KV metadata service.
"""

from __future__ import annotations

from collections import OrderedDict


class OutOfBlocks(RuntimeError):
    """Raised by allocate() when fewer free blocks remain than asked for."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[str | None] = [None] * num_blocks
        self.hash_to_block: dict[str, int] = {}
        # Free blocks in reuse order: empty ones first, then cached ones by time freed (LRU).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._stored: list[str] = []
        self._evicted: list[str] = []

    # ---------------------------------------------------------------- queries

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def cached_prefix(self, hashes: list[str]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (no refs taken)."""
        blocks = []
        for block_hash in hashes:
            block = self.hash_to_block.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    # ---------------------------------------------------------------- verbs

    def allocate(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise OutOfBlocks(f"need {num_blocks} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._forget_hash(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Take a reference on blocks found by cached_prefix()."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference per block; blocks reaching zero become reusable (hashed ones last)."""
        for block in reversed(blocks):
            if self.ref_counts[block] <= 0:
                raise ValueError(f"block {block} freed more often than referenced")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:
                    self._free.move_to_end(block, last=False)

    def cache(self, blocks: list[int], hashes: list[str]) -> None:
        """Make full blocks findable by their hashes (blocks[i] holds the block hashed hashes[i])."""
        for block, block_hash in zip(blocks, hashes):
            if self.block_hash[block] is not None or block_hash in self.hash_to_block:
                continue
            self.block_hash[block] = block_hash
            self.hash_to_block[block_hash] = block
            self._stored.append(block_hash)

    def uncache(self, blocks: list[int]) -> None:
        """Make blocks unfindable again (their bytes never arrived); they are announced as evicted."""
        for block in blocks:
            self._forget_hash(block)

    def drain_events(self) -> tuple[list[str], list[str]]:
        """Hashes stored and evicted since the last call."""
        stored, evicted = self._stored, self._evicted
        self._stored, self._evicted = [], []
        return stored, evicted

    def _forget_hash(self, block: int) -> None:
        block_hash = self.block_hash[block]
        if block_hash is not None:
            del self.hash_to_block[block_hash]
            self.block_hash[block] = None
            self._evicted.append(block_hash)
