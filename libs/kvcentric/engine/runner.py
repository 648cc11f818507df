"""With `sampling`, the only engine part that touches torch: builds the model, owns the KV cache tensors, runs steps.

It turns block tables into slot ids, runs prefill chunks and batched decode steps, and copies
one layer's KV of a request out of or into the cache as bytes. It does not decide what to run or
allocate blocks.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch

from kvcentric.engine.pools import serial_workers
from kvcentric.model.config import ModelConfig, available_memory_bytes, check_fits
from kvcentric.engine.llama import (AttentionBatch, AttentionKernels, LayerHook, LayerOps, LlamaModel, PaddedRows,
                                    SequenceSlice, SmallGemm, empty_model, load_checkpoint, projection_shapes,
                                    random_init, small_rows, use_ops)
from kvcentric.engine.staging import LayerStaging
from kvcentric.runtime.transfer import checksum

if TYPE_CHECKING:
    from kvcentric.engine.graphs import DecodeGraphs

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def slots_of(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slot ids of token positions start..end-1 of a sequence with this block table."""
    positions = torch.arange(start, end)
    blocks = torch.tensor(block_table, dtype=torch.long)[positions // block_size]
    return blocks * block_size + positions % block_size


def padded_decode(positions: list[int], tables: list[list[int]], block_size: int, window: int | None,
                  device: torch.device) -> PaddedRows:
    """Decode rows (one new token each at `positions`) laid out for one attention call: their [batch, max_blocks]
    block table (padded with block 0), its [batch, 1, 1, max_blocks * block_size] mask, their context lengths,
    and the slots their new tokens take. Built from Python lists in one tensor each (a per-row tensor cost
    0.7 ms a step at batch 32)."""
    used = [p // block_size + 1 for p in positions]
    count = max(used)
    blocks = torch.tensor([table[:n] + [0] * (count - n) for table, n in zip(tables, used)], dtype=torch.long)
    query_pos = torch.tensor(positions, dtype=torch.long)
    key_pos = torch.arange(count * block_size).unsqueeze(0)
    mask = key_pos <= query_pos[:, None]
    if window is not None:
        mask &= key_pos > query_pos[:, None] - window
    write = torch.tensor([table[p // block_size] * block_size + p % block_size for table, p in zip(tables, positions)],
                         dtype=torch.long)
    return PaddedRows(blocks.to(device), mask[:, None, None, :].to(device), query_pos.add(1).to(device), write)


def build_model(config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device,
                onednn: bool = True) -> LlamaModel:
    """The checkpoint's weights when the config has a path, else seeded random weights; either way made
    on `device` in `dtype` (never a full fp32 copy on the host first). `onednn`: fp32 projections on the CPU
    run through oneDNN's GEMM (`llama.pack_weight`)."""
    model = empty_model(config, dtype, device)
    model = load_checkpoint(model, config.path) if config.path else random_init(model, seed)
    return model.eval().fuse(pack=onednn)


def device_kernels(config: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int,
                   cpu: bool = True, gpu: bool = True,
                   onednn: bool = True) -> tuple[AttentionKernels | None, LayerOps | None]:
    """The attention kernels and fused layer ops of the device, or None for either (torch's ops).

    On the CPU: the C++ attention kernels (`engine/kernels`, built on first use) for an fp32 or bf16 model when
    `cpu` and they build, and for fp32 the fused SwiGLU, RMSNorm, rotary + cache write and small GEMM of the same
    library; each only where it beats torch's op on this CPU at the model's shapes (`kernels/chosen.py`,
    KVC_KERNELS; `onednn`: torch's GEMM is oneDNN's over blocked weights). On CUDA,
    when `gpu`: the Triton paged decode (`kernels/paged.py`) and fused norm, rotary + cache write and SwiGLU
    (`kernels/fused.py`), once they pass their check at the model's shapes (`gpu_kernels_work`)."""
    if device.type == "cuda":
        if not gpu or not gpu_kernels_work(config, dtype, device, block_size):
            return None, None
        kernels = gpu_kernels()
        if kernels is None:
            return None, None
        from kvcentric.engine.kernels import fused  # imports: Triton did, just above
        return kernels, fused.FusedOps()
    if not cpu or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None, None
    from kvcentric.engine.kernels import chosen  # builds nothing until asked: CUDA engines never load it
    return chosen.cpu_kernels(config, dtype, block_size, onednn)


def weight_copies(config: ModelConfig, ops: LayerOps | None) -> int:
    """Copies of the projections' weights a model keeps: two where the small GEMM runs for some shape
    (`llama.TwoLayouts`), else one."""
    if not hasattr(ops, "small_linear"):
        return 1
    gemm = cast(SmallGemm, ops)
    return 2 if any(small_rows(gemm, out, width) > 0 for out, width, _ in projection_shapes(config)) else 1


def gpu_kernels_work(config: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int) -> bool:
    """The Triton kernels compile on this GPU and agree with torch's ops at the model's shapes (`kernels/gpucheck`);
    False, with a warning that says why, where they do not (the engine then runs torch's ops, eagerly)."""
    try:
        from kvcentric.engine.kernels.gpucheck import self_check
        problem = self_check(config, dtype, device, block_size)
    except ImportError:
        return True  # no Triton: gpu_kernels() says so
    except Exception as error:  # a compile or launch failure on this device
        problem = f"{type(error).__name__}: {str(error)[:300]}"
    if problem is not None:
        warnings.warn(f"the GPU kernels failed their check on {device}: {problem}; "
                      "running torch's ops without CUDA graphs", RuntimeWarning, stacklevel=2)
    return problem is None


def gpu_kernels() -> AttentionKernels | None:
    """The Triton paged decode kernel, or None (with a warning) where Triton is missing."""
    try:
        from kvcentric.engine.kernels import paged
    except ImportError as error:
        warnings.warn(f"Triton is not importable ({error}): CUDA decode attention gathers the KV into a padded copy "
                      "and steps run without CUDA graphs", RuntimeWarning, stacklevel=2)
        return None
    return paged.load()


PromptChunk = tuple[list[int], list[int], int, int]
"""(token_ids, block_table, start, end): positions start..end-1 of a prompt to compute."""


@dataclasses.dataclass
class PromptRows:
    """Prompt chunks laid out as the rows of one pass (`ModelRunner.prompt_rows`)."""

    ids: list[int] = dataclasses.field(default_factory=list)
    positions: list[torch.Tensor] = dataclasses.field(default_factory=list)
    writes: list[torch.Tensor] = dataclasses.field(default_factory=list)
    sequences: list[SequenceSlice] = dataclasses.field(default_factory=list)
    last_rows: list[int] = dataclasses.field(default_factory=list)


class LayerwiseExecution(Protocol):
    """Runs prefill and decode over per-layer block tables instead (`engine/layered.py`, LayerKV)."""

    def prefill(self, token_ids: list[int], block_table: list[int], start: int, end: int,
                on_layer: LayerHook | None = None, every_row: bool = False) -> torch.Tensor: ...

    def decode(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor: ...

    def read_layer(self, layer: int, block_table: list[int], start: int, end: int) -> tuple[bytes, bytes, int]: ...


class ModelRunner:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, seed: int = 0,
                 dtype: str = "float32", device: str = "cpu", onednn: bool = True, cpu_kernels: bool = True,
                 gpu_kernels: bool = True, cuda_graphs: bool = True) -> None:
        """`cpu_kernels`: attention runs through the CPU kernels (`engine/kernels`, built on first use; fp32 and
        bf16) where they build and beat torch's ops (`kernels/chosen.py`); else through SDPA, decode rows over a
        gathered copy. `gpu_kernels`: on CUDA,
        decode attention reads the paged cache in place through a Triton kernel (`kernels/paged.py`).
        With `gpu_kernels` the layers' norms, rotary + cache write and SwiGLU run fused (`kernels/fused.py`).
        `cuda_graphs`: with that kernel, the cache gets one spare block for the padding rows of decode steps
        replayed from CUDA graphs (`capture_decode_graphs`, `engine/graphs.py`)."""
        self.config = config
        self.num_blocks = num_blocks
        """KV blocks the allocator may hand out (the cache may hold one more: the graphs' spare block)."""
        self.block_size = block_size
        self.dtype = DTYPES[dtype]
        self.dtype_name = dtype
        self.device = torch.device(device)
        dtype_size = torch.tensor([], dtype=self.dtype).element_size()
        kv_bytes = num_blocks * block_size * config.kv_bytes_per_token(dtype_size)
        self.kernels, ops = device_kernels(config, self.dtype, self.device, block_size, cpu_kernels, gpu_kernels,
                                           onednn)
        if self.device.type == "cpu":  # an fp32 model's projections in two layouts (`llama.TwoLayouts`)
            check_fits(config, kv_bytes, dtype_size, available_memory_bytes(), weight_copies(config, ops))
        self.model = build_model(config, seed, self.dtype, self.device, onednn)
        use_ops(self.model, ops)
        spare = int(cuda_graphs and self.device.type == "cuda" and self.kernels is not None)
        shape = (config.num_layers, (num_blocks + spare) * block_size, config.num_kv_heads, config.head_dim)
        # Preallocated and touched once (zeros), so no step pays for first-touch page faults.
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.graphs: DecodeGraphs | None = None
        """Decode steps replayed from CUDA graphs, once `capture_decode_graphs` has run."""
        self.threads = 0
        """The torch threads its model thread computes with (set by the service that runs it)."""
        self.layered: LayerwiseExecution | None = None
        """With LayerKV: block tables name logical blocks whose layers live apart; this runs the steps."""

    def capture_decode_graphs(self, max_batch: int) -> bool:
        """Capture decode steps of up to `max_batch` sequences as CUDA graphs (`engine/graphs.py`), used by every
        later `decode` that fits; False (nothing captured) where the runner has no spare block for them (not
        CUDA, no Triton kernel, or built with cuda_graphs off) or runs LayerKV."""
        if self.k_cache.shape[1] == self.num_blocks * self.block_size or self.layered is not None:
            return False
        if self.graphs is not None and self.graphs.buckets[-1] >= max_batch:
            return True  # captured already (a runner handed over by a role change)
        from kvcentric.engine.graphs import DecodeGraphs
        self.graphs = DecodeGraphs(self, max_batch, self.num_blocks * self.block_size, capture=True)
        return True

    @property
    def layer_token_bytes(self) -> int:
        """Bytes of one token's key (or value) in one layer."""
        return self.config.num_kv_heads * self.config.head_dim * self.k_cache.element_size()

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        return slots_of(block_table, start, end, self.block_size).to(self.device)

    def prefill(self, token_ids: list[int], block_table: list[int], start: int, end: int | None = None,
                on_layer: LayerHook | None = None, every_row: bool = False,
                before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute positions start..end-1 of one sequence whose KV for 0..start-1 is cached; the logits of the
        last position, or of every position ([end - start, vocab]) with `every_row`. `before_layer(L)` is
        called before layer L computes (a prefix still loading layer by layer waits there)."""
        end = len(token_ids) if end is None else end
        if self.layered is not None:
            return self.layered.prefill(token_ids, block_table, start, end, on_layer, every_row)
        self._wait_for_received_kv()
        context = self._slots(block_table, 0, end)
        sequence = SequenceSlice(0, end - start, context, start, self.config.sliding_window)
        batch = AttentionBatch(torch.arange(start, end, device=self.device), context[start:], [sequence],
                               kernels=self.kernels)
        ids = torch.tensor(token_ids[start:end], device=self.device)
        if every_row:
            rows = torch.arange(end - start, device=self.device)
            return self.model(ids, batch, self.k_cache, self.v_cache, rows, on_layer, before_layer)
        rows = torch.tensor([end - start - 1], device=self.device)
        return self.model(ids, batch, self.k_cache, self.v_cache, rows, on_layer, before_layer)[0]

    def prompt_rows(self, chunks: Sequence[PromptChunk]) -> PromptRows:
        """The flat rows of several prompts' chunks in one pass: token ids, positions, the slots their KV goes to,
        one `SequenceSlice` each, and the row of each chunk's last position."""
        rows = PromptRows()
        for token_ids, block_table, start, end in chunks:
            context = self._slots(block_table, 0, end)
            rows.sequences.append(SequenceSlice(len(rows.ids), len(rows.ids) + end - start, context, start,
                                                self.config.sliding_window))
            rows.ids += token_ids[start:end]
            rows.positions.append(torch.arange(start, end))
            rows.writes.append(context[start:])
            rows.last_rows.append(len(rows.ids) - 1)
        return rows

    def prefill_many(self, chunks: Sequence[PromptChunk], on_layer: LayerHook | None = None) -> torch.Tensor:
        """Chunks of several prompts ((token_ids, block_table, start, end), each cached before `start`) in one
        pass; the logits of each chunk's last position, [chunks, vocab]. `on_layer` sees every chunk's rows
        of a layer together, in the order given."""
        if self.layered is not None:
            raise ValueError("LayerKV computes one prompt's chunk per step")
        self._wait_for_received_kv()
        rows = self.prompt_rows(chunks)
        batch = AttentionBatch(torch.cat(rows.positions).to(self.device),
                               torch.cat([w.to(self.device) for w in rows.writes]), rows.sequences,
                               kernels=self.kernels)
        return self.model(torch.tensor(rows.ids, device=self.device), batch, self.k_cache, self.v_cache,
                          torch.tensor(rows.last_rows, dtype=torch.long, device=self.device), on_layer)

    def decode(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """One new token per sequence at `positions`; returns logits [sequences, vocab]."""
        if self.layered is not None:
            return self.layered.decode(token_ids, positions, block_tables)
        self._wait_for_received_kv()
        if self.graphs is not None:
            logits = self.graphs.run(token_ids, positions, block_tables)
            if logits is not None:
                return logits
        padded = padded_decode(positions, block_tables, self.block_size, self.config.sliding_window, self.device)
        batch = AttentionBatch(torch.tensor(positions, device=self.device), padded.write.to(self.device),
                               padded=padded, block_size=self.block_size, kernels=self.kernels)
        ids = torch.tensor(token_ids, device=self.device)
        return self.model(ids, batch, self.k_cache, self.v_cache, torch.arange(len(positions), device=self.device))

    def read_layer(self, layer: int, block_table: list[int], start: int, end: int) -> tuple[bytes, bytes, int]:
        """Key bytes, value bytes and their checksum (CRC-32C) for token positions start..end-1 of a sequence."""
        if self.layered is not None:
            return self.layered.read_layer(layer, block_table, start, end)
        return kv_payload(*self.layer_kv(layer, block_table, start, end))

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
        """The pinned staging buffers a layer's KV leaves the GPU through (`engine/staging.py`); CUDA only."""
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
        """`out[i] = rows[index[i]]` in host memory, split over a few threads: one thread's gather (about 8 GB/s
        measured on an H200 host) is slower than an 8B model computes a prompt's layers, while the host's memory
        takes several times that. The threads let go of the GIL inside each index_select."""
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


def kv_payload(keys: torch.Tensor, values: torch.Tensor) -> tuple[bytes, bytes, int]:
    """Tensors to wire bytes (C order, on the host) and their checksum (`transfer.checksum`, CRC-32C).

    The bytes are the cache's own, whatever its dtype: the tensor is reinterpreted as bytes before it leaves
    torch, so bfloat16 (which numpy lacks) travels like float16 and float32, with no conversion."""
    key, value = raw_bytes(keys), raw_bytes(values)
    return key, value, checksum(key, value)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's memory as bytes, in C order, copied to the host once."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
