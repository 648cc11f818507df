"""The KV a decode instance keeps when a prompt's push breaks off (its prefill instance died mid-prompt), and serves
to the prefill instance that computes the request's continuation, so that it computes only the rest of the prompt.

When the sink aborts a push, the request's cache blocks whose every layer arrived (`DecodeEngine.received_blocks`)
get the chained hashes a prefill gives the same tokens (`core/hashing.py`) and stay findable by them once the
request frees them (`BlockPool.cache`: free, reused last, so a block kept never leaks and never keeps a live
request from room). The instance announces them to kvs-meta like any block it holds (tier "device"), the
conductor places the continuation on a prefill instance that pulls them from this instance's messenger
(`KVTransfer.PullBlocks`, `KeptKV.read_blocks`) when that is quicker than computing them, and they are forgotten
again once served whole, reused, or `--kv-keep-s` after they were kept (`core/kept_kv.py`).

It keeps, serves and forgets; it does not decide where the continuation goes (the conductor does).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.hashing import BlockHasher, to_hex
from kvcentric.core.kept_kv import KeptBlocks
from kvcentric.engine.cores.decode import DecodeEngine
from kvcentric.engine.service.writeback import read_block


STATS = ("kv_pushes_broken_kept", "kv_blocks_kept", "kv_tokens_kept", "kv_blocks_kept_expired",
         "kv_blocks_kept_served", "kv_blocks_kept_handed_over")
"""What `KeptKV.stats` counts (running totals): pushes whose KV was kept, blocks and tokens kept, blocks forgotten
when their time ran out, blocks served to pulls, and blocks forgotten once served whole."""


class KeptKV:
    """The blocks of broken pushes that `engine` keeps findable for `keep_s` seconds; a messenger's block source."""

    def __init__(self, engine: DecodeEngine, hasher: BlockHasher, keep_s: float) -> None:
        if hasher.block_size != engine.runner.block_size:
            raise ValueError("the hasher's block size must equal the cache's")
        if engine.runner.layered is not None:
            raise ValueError("a LayerKV cache has no whole blocks to keep")
        self.engine, self.hasher = engine, hasher
        self.kept = KeptBlocks(keep_s)
        self.stats: collections.Counter[str] = collections.Counter(dict.fromkeys(STATS, 0))
        self.announces = False
        """Whether this instance has kept a block yet (from then on it announces its cache's blocks)."""

    @property
    def pool(self) -> BlockPool:
        return self.engine.kv.pool

    def keep(self, request_id: str, now: float) -> int:
        """The push of `request_id` broke off: before its blocks are freed, leave those whose every layer arrived
        findable by their hashes; returns how many."""
        blocks, tokens = self.engine.received_blocks(request_id)
        if not blocks or not self.kept.keep_s:
            return 0
        hashes = [to_hex(h) for h in self.hasher.hash_blocks(tokens)]
        self.engine.kv.cache(blocks, hashes)
        self.kept.keep(hashes, now)
        self.announces = True
        self.stats["kv_pushes_broken_kept"] += 1
        self.stats["kv_blocks_kept"] += len(blocks)
        self.stats["kv_tokens_kept"] += len(tokens)
        return len(blocks)

    def expire(self, now: float) -> int:
        """Forget the blocks whose time ran out (announced as evicted); returns how many were still here."""
        return self._forget(self.kept.due(now), "kv_blocks_kept_expired")

    def _forget(self, block_hashes: list[str], counter: str) -> int:
        blocks = [block for h in block_hashes if (block := self.pool.hash_to_block.get(h)) is not None]
        self.engine.kv.uncache(blocks)
        self.stats[counter] += len(blocks)
        return len(blocks)

    def read_blocks(self, block_hashes: list[str], dtype: str, block_size: int) -> Iterator[tuple[str, bytes | None]]:
        """The messenger's block source: the leading `block_hashes` this cache holds, in host-pool layout (None
        for the first one it does not hold, and nothing after it). Blocks served whole are forgotten: the
        puller's pool holds them now. Read in the event loop, which is where blocks are allocated too, so a block
        found is not reused while it is read."""
        runner = self.engine.runner
        if dtype != runner.dtype_name or block_size != runner.block_size:
            raise ValueError(f"blocks here are {runner.dtype_name} x {runner.block_size} tokens, "
                             f"asked for {dtype} x {block_size}")
        for block_hash in block_hashes:
            block = self.pool.hash_to_block.get(block_hash)
            if block is None:
                yield block_hash, None
                return
            data = read_block(runner, block)
            self.stats["kv_blocks_kept_served"] += 1
            yield block_hash, data
        self._forget(self.kept.release(block_hashes), "kv_blocks_kept_handed_over")
