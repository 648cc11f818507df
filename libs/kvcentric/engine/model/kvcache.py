"""A paged KV cache's tensors on one device, [num_layers, slots, kv_heads, head_dim] for keys and for values with
slot = block * block_size + offset, and every copy into or out of them: a request's layers as wire bytes, whole
blocks to and from the host pool's layout, a layer at a time beside the compute (CUDA side streams, pinned
memory). It computes nothing (the model runner does) and allocates no block (`core/kv_cache.py`).
"""

from __future__ import annotations

import os
import warnings

import torch

from kvcentric.engine.model.pools import serial_workers
from kvcentric.engine.model.staging import LayerStaging
from kvcentric.model.config import ModelConfig


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slot ids of token positions start..end-1 of a sequence with this block table."""
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_table, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def _tensor(data: bytes | memoryview, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    """A tensor over received bytes without copying them (read-only: only ever copied from)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the buffer is not writable
        return torch.frombuffer(data, dtype=dtype).view(shape)


MAX_RUNS = 8
"""A layer-wise load from a layer-major pool copies its slots run by run up to this many runs; a prefix more
scattered than that over the pool is gathered, as from a block-major one."""


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(index in `slots`, first slot, count) of each run of consecutive slots, in order."""
    runs: list[tuple[int, int, int]] = []
    for at, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((at, slot, 1))
    return runs


def block_slots(blocks: list[int], block_size: int) -> torch.Tensor:
    return (torch.tensor(blocks, dtype=torch.long)[:, None] * block_size + torch.arange(block_size)).reshape(-1)


class PagedKVCache:
    def __init__(self, config: ModelConfig, num_slots: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config, self.block_size, self.dtype, self.device = config, block_size, dtype, device
        shape = (config.num_layers, num_slots, config.num_kv_heads, config.head_dim)
        # Preallocated and touched once (zeros), so no step pays for first-touch page faults.
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        return slots_of(block_table, start, end, self.block_size).to(self.device)

    @property
    def layer_token_bytes(self) -> int:
        """Bytes of one token's key (or value) in one layer."""
        return self.config.num_kv_heads * self.config.head_dim * self.k_cache.element_size()

    def layer_kv(self, layer: int, block_table: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one layer's keys and values ([end - start, kv heads, head dim]) of positions start..end-1
        (a plain cache: with LayerKV, `read_layer` asks the layer's own tables)."""
        slots = self._slots(block_table, start, end)
        return self.k_cache[layer, slots], self.v_cache[layer, slots]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, key and value: the host pool's unit."""
        return self.config.num_layers * 2 * self.block_size * self.layer_token_bytes

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks), num_layers, 2, block_size, kv_heads, head_dim] copies of cache blocks, on the host."""
        slots = block_slots(blocks, self.block_size).to(self.device)
        both = torch.stack([self.k_cache[:, slots], self.v_cache[:, slots]], dim=1)  # [L, 2, n*bs, H, D]
        shape = (self.config.num_layers, 2, len(blocks), self.block_size, *both.shape[-2:])
        return both.view(shape).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()

    def copy_block(self, source: int, target: int) -> None:
        """Copy one cache block's KV, every layer, into another (a sequence forked from a partial block)."""
        slots = block_slots([source, target], self.block_size).to(self.device)
        half = self.block_size
        self.k_cache[:, slots[half:]] = self.k_cache[:, slots[:half]]
        self.v_cache[:, slots[half:]] = self.v_cache[:, slots[:half]]

    def copy_point(self) -> torch.cuda.Event | None:
        """A mark after the work queued so far on the compute stream (CUDA; None on CPU): a copy that
        starts from it sees every layer already computed."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy_blocks_to_host(self, blocks: list[int], host: torch.Tensor, slots: list[int],
                            ready: torch.cuda.Event | None = None) -> None:
        """Copy cache blocks into rows `slots` of `host` (`host_rows`: a host pool's rows, either layout),
        returning once the bytes are there. Runs in a worker thread beside the model, in a few whole-batch
        ops (each lets go of the GIL: a loop per block would hold it from the model thread): on CUDA on a side
        stream that starts at `ready` (`copy_point`), through pinned memory. The blocks must stay referenced
        until it returns."""
        rows = self.host_rows(host)
        index = torch.tensor(slots, dtype=torch.long)
        if self.device.type != "cuda":
            for which, cache in enumerate((self.k_cache, self.v_cache)):
                rows[index, :, which] = self._gather_blocks(cache, blocks).transpose(0, 1)
            return
        stream = self._side_stream("host_write")
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            staged = torch.stack([self._gather_blocks(c, blocks) for c in (self.k_cache, self.v_cache)], dim=2)
            staged = staged.transpose(0, 1).contiguous()  # [blocks, layers, 2, block_size, heads, dim]
            pinned = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
            pinned.copy_(staged, non_blocking=True)  # one DMA
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        rows[index] = pinned

    def copy_layer_to_host(self, layer: int, blocks: list[int], host: torch.Tensor, slots: list[int],
                           ready: torch.cuda.Event | None = None) -> None:
        """Copy one layer of cache blocks into rows `slots` of `host` (host pool layout), returning once the
        bytes are there (Mooncake §5.2: new KV stored layer by layer as each layer is computed). Runs in the
        host-write worker; on CUDA on its side stream from `ready` (`copy_point` after the layer)."""
        config = self.config
        rows = self.host_rows(host)
        index = torch.tensor(slots, dtype=torch.long)
        shape = (-1, self.block_size, config.num_kv_heads, config.head_dim)
        if self.device.type != "cuda":
            target = torch.tensor(blocks, dtype=torch.long)
            for which, cache in enumerate((self.k_cache, self.v_cache)):
                rows[index, layer, which] = cache[layer].view(shape)[target]
            return
        stream = self._side_stream("host_write")
        with torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            # Made on the side stream: an index made on the compute stream could be read here before its
            # copy to the device landed, or freed and reused by the compute while this copy still reads it.
            target = torch.tensor(blocks, dtype=torch.long).to(self.device)
            staged = torch.stack([cache[layer].view(shape)[target] for cache in (self.k_cache, self.v_cache)], dim=1)
            pinned = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
            pinned.copy_(staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        rows[index, layer] = pinned

    def _gather_blocks(self, cache: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        """[layers, len(blocks), block_size, heads, dim]: the blocks' slots of every layer (a copy)."""
        by_block = cache.view(cache.shape[0], -1, self.block_size, *cache.shape[2:])
        return by_block[:, torch.tensor(blocks, dtype=torch.long, device=cache.device)]

    def _side_stream(self, name: str) -> torch.cuda.Stream:
        """A CUDA stream of its own for one kind of copy, made on first use."""
        streams = self.__dict__.setdefault("_streams", {})
        if name not in streams:
            streams[name] = torch.cuda.Stream(self.device)
        return streams[name]

    @property
    def staging(self) -> LayerStaging:
        """The pinned staging buffers a layer's KV leaves the GPU through (`engine/model/staging.py`); CUDA only."""
        if "_staging" not in self.__dict__:
            self.__dict__["_staging"] = LayerStaging(self.device)
        return self.__dict__["_staging"]

    def _wait_for_received_kv(self) -> None:
        """Steps on the compute stream start after every received layer's copy into the cache (CUDA)."""
        received = self.__dict__.get("_streams", {}).get("kv_in")
        if received is not None:
            torch.cuda.current_stream(self.device).wait_stream(received)

    def load_host_layer(self, layer: int, buffer: torch.Tensor, slots: list[int],
                        blocks: list[int]) -> torch.cuda.Event | None:
        """Copy layer `layer` of host-pool rows `slots` (`buffer`: `host_rows`, either layout) into cache blocks
        `blocks` (Mooncake §5.2: a prefix loads layer by layer). On CPU the copy is done on return; on CUDA it is
        enqueued on a side stream (through pinned memory) and the returned event marks its end. Called from a
        loader thread: each op lets go of the GIL. Where the layer's rows are contiguous (a layer-major pool),
        each run of consecutive slots is copied as one range, with no gather (`_load_runs`)."""
        rows = self.host_rows(buffer)
        if rows[:, layer].is_contiguous() and len(slot_runs(slots)) <= MAX_RUNS:
            return self._load_runs(layer, rows[:, layer], slots, blocks)
        index = torch.tensor(slots, dtype=torch.long)
        pinned = self.device.type == "cuda"
        part = torch.empty((len(slots), 2, *rows.shape[3:]), dtype=self.dtype, pin_memory=pinned)
        if pinned:
            self._gather_rows(rows[:, layer], index, part)
        else:
            torch.index_select(rows[:, layer], 0, index, out=part)  # [blocks, 2, block_size, heads, dim]
        if not pinned:
            self._install_layer(layer, block_slots(blocks, self.block_size), part)
            return None
        stream = self._side_stream("prefix_in")
        with torch.cuda.stream(stream):
            # The slot index goes to the device on the side stream itself: made on the compute stream it could
            # be read before its copy landed, or freed and reused there while this copy still reads it (seen
            # on an H200 as index_copy_ out of bounds).
            target = block_slots(blocks, self.block_size).to(self.device)
            self._install_layer(layer, target, part.to(self.device, non_blocking=True))
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def host_rows(self, host: torch.Tensor) -> torch.Tensor:
        """[slots, layers, 2, block_size, heads, dim] in the cache's dtype over a host pool's bytes: `host` is
        [slots, block bytes] (block-major) or `HostBlockPool.rows` ([slots, layers, layer bytes], either layout)."""
        config = self.config
        if host.dim() == 2:
            host = host.view(host.shape[0], config.num_layers, -1)
        return host.view(self.dtype).unflatten(-1, (2, self.block_size, config.num_kv_heads, config.head_dim))

    def _load_runs(self, layer: int, rows: torch.Tensor, slots: list[int],
                   blocks: list[int]) -> torch.cuda.Event | None:
        """`load_host_layer` from contiguous rows: each run of consecutive slots is one range of memory, copied
        block-wise into the cache (on CUDA straight from the page-locked pool to the device, one DMA a run)."""
        shape = (-1, self.block_size, self.config.num_kv_heads, self.config.head_dim)
        caches = (self.k_cache[layer].view(shape), self.v_cache[layer].view(shape))
        if self.device.type != "cuda":
            for at, first, count in slot_runs(slots):
                target = torch.tensor(blocks[at:at + count], dtype=torch.long)
                for which, cache in enumerate(caches):
                    cache.index_copy_(0, target, rows[first:first + count, which])
            return None
        stream = self._side_stream("prefix_in")
        with torch.cuda.stream(stream):
            for at, first, count in slot_runs(slots):
                target = torch.tensor(blocks[at:at + count], dtype=torch.long).to(self.device)
                part = rows[first:first + count].to(self.device, non_blocking=True)
                for which, cache in enumerate(caches):
                    cache.index_copy_(0, target, part[:, which])
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def _gather_rows(self, rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
        """`out[i] = rows[index[i]]` in host memory, split over a few threads: one thread's gather is slower than
        an 8B model on a GPU computes a prompt's layers, while the host's memory takes several times one thread's
        rate (docs/performance.md, "KV off the first-token path"). The threads let go of the GIL inside each
        index_select."""
        threads = max(1, min(8, (os.cpu_count() or 2) // 2))
        if "_gatherers" not in self.__dict__:
            self.__dict__["_gatherers"] = serial_workers(threads, "kv-gather")
        pool = self.__dict__["_gatherers"]
        pieces = max(1, min(threads, index.numel() // 16))
        bounds = [index.numel() * i // pieces for i in range(pieces + 1)]
        futures = [pool.submit(torch.index_select, rows, 0, index[lo:hi], out=out[lo:hi])
                   for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        for future in futures:
            future.result()

    def _install_layer(self, layer: int, target: torch.Tensor, part: torch.Tensor) -> None:
        shape = (-1, self.config.num_kv_heads, self.config.head_dim)
        self.k_cache[layer].index_copy_(0, target, part[:, 0].reshape(shape))
        self.v_cache[layer].index_copy_(0, target, part[:, 1].reshape(shape))

    def write_block(self, block: int, data: torch.Tensor) -> None:
        """Install one block's bytes (host pool layout) into cache block `block`."""
        shape = (self.config.num_layers, 2, self.block_size, self.config.num_kv_heads, self.config.head_dim)
        values = data.reshape(-1).view(self.dtype).view(shape).to(self.device)
        slots = block_slots([block], self.block_size).to(self.device)
        self.k_cache[:, slots] = values[:, 0]
        self.v_cache[:, slots] = values[:, 1]

    def write_layer(self, layer: int, block_table: list[int], start: int, end: int,
                    key: bytes, value: bytes) -> None:
        """Store received KV for token positions start..end-1 of a sequence."""
        shape = (end - start, self.config.num_kv_heads, self.config.head_dim)
        expected = shape[0] * self.layer_token_bytes
        if len(key) != expected or len(value) != expected:
            raise ValueError(f"layer {layer}: expected {expected} bytes each for key and value, "
                             f"got {len(key)} and {len(value)}")
        if self.device.type == "cuda":  # on a stream of its own; the next step waits for it
            with torch.cuda.stream(self._side_stream("kv_in")):
                self._write_slots(layer, block_table, start, end, key, value, shape)
            return
        self._write_slots(layer, block_table, start, end, key, value, shape)

    def _write_slots(self, layer: int, block_table: list[int], start: int, end: int, key, value, shape) -> None:
        """Received bytes into the cache: on CUDA through pinned memory (the caching host allocator keeps a
        pinned block until the copy that reads it is done) and a copy that does not block this thread."""
        slots = self._slots(block_table, start, end)
        for cache, data in ((self.k_cache, key), (self.v_cache, value)):
            host = _tensor(data, self.dtype, shape)
            if self.device.type == "cuda":
                host = host.pin_memory()
            cache[layer].index_copy_(0, slots, host.to(self.device, non_blocking=True))
