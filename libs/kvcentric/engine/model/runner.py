"""The model runner: builds the model on its device and runs prefill chunks and batched decode steps over its paged
KV cache (`kvcache.PagedKVCache`, whose tensors and copies it inherits), and reads a request's layer as wire bytes
(through LayerKV's tables where it runs). It does not decide what to run or allocate blocks.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, cast

import torch

from kvcentric.model.config import ModelConfig, available_memory_bytes, check_fits
from kvcentric.engine.model.batch import AttentionBatch, PaddedRows, SequenceSlice
from kvcentric.engine.model.dispatch import use_ops
from kvcentric.engine.model.gemm import projection_shapes, small_rows
from kvcentric.engine.model.llama import LayerHook, LlamaModel
from kvcentric.engine.model.ops import AttentionKernels, LayerOps, SmallGemm
from kvcentric.engine.model.weights import empty_model, load_checkpoint, random_init
from kvcentric.engine.model.kvcache import PagedKVCache
from kvcentric.runtime.transfer import checksum

if TYPE_CHECKING:
    from kvcentric.engine.model.graphs import DecodeGraphs

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def padded_decode(positions: list[int], tables: list[list[int]], block_size: int, window: int | None,
                  device: torch.device) -> PaddedRows:
    """Decode rows (one new token each at `positions`) laid out for one attention call: their [batch, max_blocks]
    block table (padded with block 0), its [batch, 1, 1, max_blocks * block_size] mask, their context lengths,
    and the slots their new tokens take. Built from Python lists in one tensor each (a tensor per row costs a
    dispatch per row, which adds up at a large batch)."""
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
    run through oneDNN's GEMM (`gemm.pack_weight`)."""
    model = empty_model(config, dtype, device)
    model = load_checkpoint(model, config.path) if config.path else random_init(model, seed)
    return model.eval().fuse(pack=onednn)


def device_kernels(config: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int,
                   cpu: bool = True, gpu: bool = True,
                   onednn: bool = True) -> tuple[AttentionKernels | None, LayerOps | None]:
    """The attention kernels and fused layer ops of the device, or None for either (torch's ops).

    On the CPU: the C++ attention kernels (`engine/model/kernels`, built on first use) for an fp32 or bf16 model when
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
        from kvcentric.engine.model.kernels import fused  # imports: Triton did, just above
        return kernels, fused.FusedOps()
    if not cpu or device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None, None
    from kvcentric.engine.model.kernels import chosen  # builds nothing until asked: CUDA engines never load it
    return chosen.cpu_kernels(config, dtype, block_size, onednn)


def weight_copies(config: ModelConfig, ops: LayerOps | None) -> int:
    """Copies of the projections' weights a model keeps: two where the small GEMM runs for some shape
    (`gemm.TwoLayouts`), else one."""
    if not hasattr(ops, "small_linear"):
        return 1
    gemm = cast(SmallGemm, ops)
    return 2 if any(small_rows(gemm, out, width) > 0 for out, width, _ in projection_shapes(config)) else 1


def gpu_kernels_work(config: ModelConfig, dtype: torch.dtype, device: torch.device, block_size: int) -> bool:
    """The Triton kernels compile on this GPU and agree with torch's ops at the model's shapes (`kernels/gpucheck`);
    False, with a warning that says why, where they do not (the engine then runs torch's ops, eagerly)."""
    try:
        from kvcentric.engine.model.kernels.gpucheck import self_check
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
        from kvcentric.engine.model.kernels import paged
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
    """Runs prefill and decode over per-layer block tables instead (`engine/kv/layered.py`, LayerKV)."""

    def prefill(self, token_ids: list[int], block_table: list[int], start: int, end: int,
                on_layer: LayerHook | None = None, every_row: bool = False) -> torch.Tensor: ...

    def decode(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor: ...

    def read_layer(self, layer: int, block_table: list[int], start: int, end: int) -> tuple[bytes, bytes, int]: ...


class ModelRunner(PagedKVCache):
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, seed: int = 0,
                 dtype: str = "float32", device: str = "cpu", onednn: bool = True, cpu_kernels: bool = True,
                 gpu_kernels: bool = True, cuda_graphs: bool = True) -> None:
        """`cpu_kernels`: attention runs through the CPU kernels (`engine/model/kernels`, built on first use; fp32 and
        bf16) where they build and beat torch's ops (`kernels/chosen.py`); else through SDPA, decode rows over a
        gathered copy. `gpu_kernels`: on CUDA,
        decode attention reads the paged cache in place through a Triton kernel (`kernels/paged.py`).
        With `gpu_kernels` the layers' norms, rotary + cache write and SwiGLU run fused (`kernels/fused.py`).
        `cuda_graphs`: with that kernel, the cache gets one spare block for the padding rows of decode steps
        replayed from CUDA graphs (`capture_decode_graphs`, `engine/model/graphs.py`)."""
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
        if self.device.type == "cpu":  # an fp32 model's projections in two layouts (`gemm.TwoLayouts`)
            check_fits(config, kv_bytes, dtype_size, available_memory_bytes(), weight_copies(config, ops))
        self.model = build_model(config, seed, self.dtype, self.device, onednn)
        use_ops(self.model, ops)
        spare = int(cuda_graphs and self.device.type == "cuda" and self.kernels is not None)
        super().__init__(config, (num_blocks + spare) * block_size, block_size, self.dtype, self.device)
        self.graphs: DecodeGraphs | None = None
        """Decode steps replayed from CUDA graphs, once `capture_decode_graphs` has run."""
        self.threads = 0
        """The torch threads its model thread computes with (set by the service that runs it)."""
        self.layered: LayerwiseExecution | None = None
        """With LayerKV: block tables name logical blocks whose layers live apart; this runs the steps."""

    def capture_decode_graphs(self, max_batch: int) -> bool:
        """Capture decode steps of up to `max_batch` sequences as CUDA graphs (`engine/model/graphs.py`), used by every
        later `decode` that fits; False (nothing captured) where the runner has no spare block for them (not
        CUDA, no Triton kernel, or built with cuda_graphs off) or runs LayerKV."""
        if self.k_cache.shape[1] == self.num_blocks * self.block_size or self.layered is not None:
            return False
        if self.graphs is not None and self.graphs.buckets[-1] >= max_batch:
            return True  # captured already (a runner handed over by a role change)
        from kvcentric.engine.model.graphs import DecodeGraphs
        self.graphs = DecodeGraphs(self, max_batch, self.num_blocks * self.block_size, capture=True)
        return True


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


def kv_payload(keys: torch.Tensor, values: torch.Tensor) -> tuple[bytes, bytes, int]:
    """Tensors to wire bytes (C order, on the host) and their checksum (`transfer.checksum`, CRC-32C).

    The bytes are the cache's own, whatever its dtype: the tensor is reinterpreted as bytes before it leaves
    torch, so bfloat16 (which numpy lacks) travels like float16 and float32, with no conversion."""
    key, value = raw_bytes(keys), raw_bytes(values)
    return key, value, checksum(key, value)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's memory as bytes, in C order, copied to the host once."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
