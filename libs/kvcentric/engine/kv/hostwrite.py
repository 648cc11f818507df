"""Write-behind into the host tier: computed blocks are copied from the device cache into the node's host
pool by a worker (a thread doing the copy on CPU; on CUDA a side stream into the pinned pool), behind the
compute, so neither a request's first token nor the next prefill waits for them (Mooncake §3's DRAM pool
kept off the critical path). A prefill chunk's new full blocks go layer by layer, each layer as soon as it is
computed (Mooncake §5.2, `LayerStore`); whatever else a prompt computed goes whole when it ends (`submit`).

While a copy runs, its device blocks hold a reference (nobody reuses or evicts them) and its host slots
are reserved, not indexed: the pool finds and announces a block only once `collect` sees its bytes there.
It copies; it does not choose what to keep (the pool's eviction policy) or publish events (the reporter).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Callable

from kvcentric.core.kv_cache import KVCacheManager
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.model.pools import serial_workers
from kvcentric.engine.model.runner import ModelRunner


@dataclasses.dataclass
class LayerStore:
    """A chunk's blocks that its compute fills, going into reserved host slots one layer at a time."""

    blocks: list[int]
    slots: list[int]
    layers: list[concurrent.futures.Future] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class BlockCopy:
    """Device blocks on their way into reserved host slots (blocks[i] into slots[i])."""

    blocks: list[int]
    slots: list[int]
    done: concurrent.futures.Future


class HostWriter:
    """One worker, so copies finish in the order they were submitted and `collect` indexes them in order.
    `on_done` is called from the worker after each copy (to wake the loop that calls `collect`)."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, host: HostBlockPool,
                 on_done: Callable[[], None] | None = None) -> None:
        """`kv`: the device cache's manager, through which a copy holds a reference on each block it reads."""
        self.runner, self.kv, self.host, self.on_done = runner, kv, host, on_done
        self.worker = serial_workers(1, "host-write")
        self.copies: collections.deque[BlockCopy] = collections.deque()
        self.stats = {"host_writes_queued": 0, "host_writes_layerwise": 0, "host_writes_failed": 0,
                      "host_write_waits": 0}

    @property
    def busy(self) -> bool:
        """Copies submitted and not collected yet (their device blocks are still held)."""
        return bool(self.copies)

    def submit(self, blocks: list[int], hashes: list[str]) -> int:
        """Start copying the blocks the host pool lacks (blocks[i] is the request's i-th block, hashed
        hashes[i]); returns how many were queued. Takes a reference on each until it is collected."""
        chosen, slots = self._reserve(blocks, hashes, 0)
        if chosen:
            ready = self.runner.copy_point()
            done = self.worker.submit(self._copy, chosen, slots, ready)
            self.copies.append(BlockCopy(chosen, slots, done))
            self.stats["host_writes_queued"] += len(chosen)
        return len(chosen)

    def _reserve(self, blocks: list[int], hashes: list[str], first_depth: int) -> tuple[list[int], list[int]]:
        """Host slots for the blocks the pool lacks, and a reference on each of those device blocks."""
        chosen, slots = [], []
        for depth, (block, block_hash) in enumerate(zip(blocks, hashes), start=first_depth):
            if not self.host.wanted(block_hash):
                continue
            slot = self.host.reserve(block_hash, depth)
            if slot is None:  # every slot pinned or being written: the rest stay on the device only
                break
            chosen.append(block)
            slots.append(slot)
        self.kv.share(chosen)
        return chosen, slots

    def reserve_layers(self, blocks: list[int], hashes: list[str], first_depth: int) -> LayerStore | None:
        """Before a chunk runs (the pools' thread): slots for the blocks it fills that the host pool lacks
        (blocks[i] is the request's block first_depth + i), which `store_layer` then fills layer by layer."""
        chosen, slots = self._reserve(blocks, hashes, first_depth)
        return LayerStore(chosen, slots) if chosen else None

    def store_layer(self, store: LayerStore, layer: int) -> None:
        """Layer `layer` of the chunk is computed (the model thread): its part of the blocks goes now."""
        ready = self.runner.copy_point()
        store.layers.append(self.worker.submit(self.runner.copy_layer_to_host, layer, store.blocks,
                                               self.host.rows(self.runner.config.num_layers), store.slots, ready))

    def end_store(self, store: LayerStore, computed: bool) -> None:
        """The chunk ran (`computed`: every layer of it) or will not: once its copies end, `collect` indexes
        its blocks, or gives their slots back when a layer is missing or failed."""
        whole = computed and len(store.layers) == self.runner.config.num_layers
        done = self.worker.submit(self._settle_layers, store.layers, whole)
        self.copies.append(BlockCopy(store.blocks, store.slots, done))
        self.stats["host_writes_queued"] += len(store.blocks)
        self.stats["host_writes_layerwise"] += len(store.blocks) if whole else 0

    def _settle_layers(self, layers: list[concurrent.futures.Future], whole: bool) -> None:
        """Runs after every layer copy (one worker, in order): raises what a copy raised, or for a chunk
        that was not computed whole."""
        try:
            for layer in layers:
                layer.result()
            if not whole:
                raise RuntimeError("the chunk was not computed: its blocks are incomplete")
        finally:
            if self.on_done is not None:
                self.on_done()

    def _copy(self, blocks: list[int], slots: list[int], ready) -> None:
        try:
            self.runner.copy_blocks_to_host(blocks, self.host.rows(self.runner.config.num_layers), slots, ready)
        finally:
            if self.on_done is not None:
                self.on_done()

    def collect(self, wait: bool = False) -> int:
        """Index the blocks whose copies are done (all of them, waiting, when `wait`) and drop their device
        references; returns how many blocks were released. Call from the thread that owns the pools."""
        released = 0
        while self.copies and (wait or self.copies[0].done.done()):
            copy = self.copies.popleft()
            try:
                copy.done.result()
            except Exception:  # noqa: BLE001 - a failed copy only means these blocks stay on the device
                self.stats["host_writes_failed"] += len(copy.slots)
                for slot in copy.slots:
                    self.host.release(slot)
            else:
                for slot in copy.slots:
                    self.host.commit(slot)
            self.kv.free(copy.blocks)
            released += len(copy.blocks)
        return released

    def wait_oldest(self) -> None:
        """Wait for the oldest copy in flight and collect what is done (the device pool is short of blocks)."""
        if self.copies:
            self.stats["host_write_waits"] += 1
            concurrent.futures.wait([self.copies[0].done])
            self.collect()

    def close(self) -> None:
        """Finish the copies in flight and stop the worker."""
        self.worker.shutdown(wait=True)
        self.collect(wait=True)
