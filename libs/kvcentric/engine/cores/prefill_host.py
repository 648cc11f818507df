"""A prefill engine's host-pool side (Mooncake §3's DRAM pool, §5.2's layer-wise load and store): the prefix a
prompt finds in the host pool is copied into its device blocks (layer by layer beside the compute, or whole
before it), and the full blocks a chunk completes go into the host pool behind the compute; it schedules no
prompt and allocates no device block (`prefill.py`, through the `KVCacheManager`).
"""

from __future__ import annotations

from kvcentric.core.kv_cache import KVCacheManager
from kvcentric.engine.kv.hostwrite import HostWriter, LayerStore
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.kv.layerload import LayerwiseLoad
from kvcentric.engine.model.llama import LayerHook
from kvcentric.engine.model.pools import serial_workers
from kvcentric.engine.model.runner import ModelRunner


class HostTier:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, host: HostBlockPool | None, layerwise_load: bool,
                 layerwise_store: bool, stats: dict) -> None:
        """`stats`: the prefill engine's, where the tokens loaded and the time waited for loads are counted."""
        self.runner, self.kv, self.host, self.stats = runner, kv, host, stats
        self.writer = HostWriter(runner, kv, host) if host is not None else None
        """Every computed full block is written to the host pool behind the compute."""
        self.layerwise_store = layerwise_store
        """A chunk's new full blocks go into the host pool layer by layer as it computes (Mooncake §5.2);
        without, a prompt's blocks go whole when it ends."""
        self.loader = serial_workers(1, "prefix-load") \
            if host is not None and layerwise_load else None
        """Loads prefixes from the host pool layer by layer beside the compute (Mooncake §5.2); without it
        a prefix is copied whole before the prompt's first chunk."""

    def prefix(self, hashes: list[str]) -> int:
        """How many leading `hashes` the host pool holds."""
        return self.host.prefix(hashes) if self.host is not None else 0

    def store_for(self, blocks: list[int], hashes: list[str], start: int, end: int) -> LayerStore | None:
        """Host slots for the full blocks that positions start..end-1 complete (Mooncake §5.2's layer-wise
        store), when there is a host pool and a plain cache."""
        if self.writer is None or self.runner.layered is not None or not self.layerwise_store:
            return None
        first, last = start // self.kv.block_size, min(end // self.kv.block_size, len(hashes))
        if first >= last:
            return None
        return self.writer.reserve_layers(blocks[first:last], hashes[first:last], first)

    def storing(self, store: LayerStore, on_layer: LayerHook | None) -> LayerHook:
        """`on_layer`, then the layer's part of the chunk's new blocks into the host pool."""
        writer = self.writer
        assert writer is not None  # a chunk has a store only when there is a host pool

        def hook(layer: int, keys, values) -> None:
            if on_layer is not None:
                on_layer(layer, keys, values)
            writer.store_layer(store, layer)
        return hook

    def end_store(self, store: LayerStore, computed: bool) -> None:
        """The chunk's layer-wise store is over: its blocks indexed when `computed`, else their slots back."""
        assert self.writer is not None
        self.writer.end_store(store, computed)

    def load(self, blocks: list[int], hashes: list[str], first: int, count: int) -> LayerwiseLoad | None:
        """Copy `count` blocks found in the host pool into the cache, after the `first` already there: layer
        by layer beside the compute when there is a loader (returned; their host slots stay pinned until it is
        closed), else whole, now. They are findable by hash at once: only this prompt's first chunk, which
        waits for each layer, or a step after it, can read them."""
        assert self.host is not None or count == 0  # blocks come from the host pool only when there is one
        if count == 0 or self.host is None:
            return None
        targets, found = blocks[first:first + count], hashes[first:first + count]
        self.kv.cache(targets, found)
        self.stats["prefill_tokens_from_host"] += count * self.kv.block_size
        if self.loader is None or self.runner.layered is not None:
            for depth, (block, block_hash) in enumerate(zip(targets, found), start=first):
                self.runner.write_block(block, self.host.view(block_hash, depth))
            return None
        slots = []
        for depth, block_hash in enumerate(found, start=first):
            self.host.view(block_hash, depth)  # counts the read, refreshes the eviction policy
            self.host.pin(block_hash)
            slots.append(self.host.slot_of[block_hash])
        rows = self.host.rows(self.runner.config.num_layers)
        return LayerwiseLoad(self.runner, targets, slots, rows).start(self.loader)

    def end_load(self, loading: LayerwiseLoad, wait: bool = True) -> None:
        """End a layer-wise load: every layer in the cache (`wait`: the compute stream waits for the copies), the
        copies finished, the host slots unpinned; a load that failed leaves its blocks unfindable."""
        try:
            if wait:
                loading.wait_all()
        finally:
            loading.close()
            if loading.error is not None:  # the prefix is not in the cache: not findable
                self.kv.uncache(loading.blocks)
            self.stats["prefix_load_wait_seconds"] += loading.waited_s
            assert self.host is not None
            for slot in loading.slots:
                self.host.unpin(self.host.hash_of[slot])
