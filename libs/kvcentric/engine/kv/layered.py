"""The model run over per-layer block tables (LayerKV §3.1.1–3.1.2, §4): a layer whose KV is all in device
blocks is read where it lies; a layer with blocks on the host is gathered into a scratch buffer, its host
blocks copied in one layer ahead while the layer before computes, and the new tokens' KV is copied back to
their homes while the next layer computes (the offload). On the CPU a worker thread does the copies; on CUDA
a side stream, the host blocks pinned. `read_layer` reads a layer's KV from wherever each block lies (a push
that resends). It executes what `core.layerkv` decided; it decides nothing.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from kvcentric.core.layerkv.pool import LayerBlockPool, Move
from kvcentric.engine.model.batch import AttentionBatch, SequenceSlice
from kvcentric.engine.model.llama import LayerHook
from kvcentric.engine.model.pools import serial_workers
from kvcentric.engine.model.kvcache import block_slots, slots_of
from kvcentric.engine.model.runner import ModelRunner, kv_payload, padded_decode

SCRATCH_BUFFERS = 3
"""Scratch buffers in turn: one being loaded, one computed in, one being written back."""
BANDWIDTH_WEIGHT = 0.2
"""How fast the measured copy bandwidth follows new copies (an exponential average)."""


@dataclasses.dataclass(frozen=True)
class SequenceStep:
    """One sequence of a step: its logical blocks and the positions start..end-1 it computes."""
    blocks: list[int]
    start: int
    end: int


@dataclasses.dataclass
class Copies:
    """Slot-to-slot copies of one layer: (source, target) index tensors per kind."""
    device_in: tuple[torch.Tensor, torch.Tensor] | None = None
    host_in: tuple[torch.Tensor, torch.Tensor] | None = None
    device_out: tuple[torch.Tensor, torch.Tensor] | None = None
    host_out: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclasses.dataclass
class LayerPlan:
    layer: int
    tables: list[list[int]]
    """Per sequence, block ids in the tensor the layer reads: the cache's layer, or the scratch buffer."""
    scratch: int | None
    """Which scratch buffer, or None: read and written in place on the device."""
    copies: Copies
    inbound: list[Move] = dataclasses.field(default_factory=list)
    """Layer blocks coming back from the host into device blocks, before the layer computes."""


class Copier:
    """Runs copies beside the compute: a worker thread on the CPU, a side stream on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.worker = serial_workers(1, "layerkv-copy") if self.stream is None else None
        self.pending: list[Any] = []

    def submit(self, fn, *args) -> Any:
        """Start `fn(*args)` after the compute queued so far; returns what `wait` takes."""
        if self.stream is None:
            assert self.worker is not None
            future = self.worker.submit(_in_inference_mode, fn, *args)
            self.pending.append(future)
            return future
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            fn(*args)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def wait(self, handle: Any) -> None:
        """The compute waits for one copy (CPU: this thread blocks; CUDA: the compute stream waits)."""
        if self.stream is None:
            handle.result()
        else:
            torch.cuda.current_stream(self.device).wait_event(handle)

    def drain(self) -> None:
        """Every copy submitted is done."""
        if self.stream is not None:
            self.stream.synchronize()
            return
        pending, self.pending = self.pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown(wait=True)


def _in_inference_mode(fn, *args) -> None:
    with torch.inference_mode():
        fn(*args)


class LayeredKV:
    """The runner's prefill and decode over a `LayerBlockPool`'s per-layer homes, with host layer blocks."""

    def __init__(self, runner: ModelRunner, pool: LayerBlockPool) -> None:
        config = runner.config
        self.runner, self.pool, self.block_size = runner, pool, pool.block_size
        shape = (pool.host_blocks * pool.block_size, config.num_kv_heads, config.head_dim)
        pinned = runner.device.type == "cuda"
        self.host_k = torch.zeros(shape, dtype=runner.dtype, pin_memory=pinned)
        self.host_v = torch.zeros(shape, dtype=runner.dtype, pin_memory=pinned)
        self.copier = Copier(runner.device)
        self.scratch: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """CUDA: (pinned keys, pinned values, host slots) gathered on the side stream, scattered at the step's end."""
        self.bandwidth_bps = 0.0
        self.stats = {"layerkv_bytes_to_host": 0, "layerkv_bytes_to_device": 0, "layerkv_layers_reloaded": 0,
                      "layerkv_layers_stored": 0, "layerkv_copy_s": 0.0}
        runner.layered = self

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's key and value in one layer."""
        return 2 * self.runner.layer_token_bytes

    # ---------------------------------------------------------------- the runner's two entry points

    def prefill(self, token_ids: list[int], block_table: list[int], start: int, end: int,
                on_layer: LayerHook | None = None, every_row: bool = False) -> torch.Tensor:
        device = self.runner.device
        ids = torch.tensor(token_ids[start:end], device=device)
        rows = torch.arange(end - start, device=device) if every_row else \
            torch.tensor([end - start - 1], device=device)
        logits = self.forward(ids, [SequenceStep(block_table, start, end)], rows, on_layer, decoding=False)
        return logits if every_row else logits[0]

    def decode(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        steps = [SequenceStep(table, position, position + 1) for table, position in zip(block_tables, positions)]
        rows = torch.arange(len(steps), device=self.runner.device)
        return self.forward(torch.tensor(token_ids, device=self.runner.device), steps, rows, decoding=True)

    def read_layer(self, layer: int, block_table: list[int], start: int, end: int) -> tuple[bytes, bytes, int]:
        """Key bytes, value bytes and their checksum for positions start..end-1 of one layer, read from each
        block's home in that layer: device blocks from the cache, host blocks from host memory (a KV push that
        resends, or sends what was not computed in this step)."""
        keys, values = self.layer_kv(layer, block_table, start, end)
        return kv_payload(keys, values)

    def layer_kv(self, layer: int, block_table: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[end - start, kv_heads, head_dim] keys and values of one layer, on the host."""
        size = self.block_size
        positions = torch.arange(start, end)
        homes = torch.tensor(self.pool.layer_table(block_table, layer), dtype=torch.long)[positions // size]
        within = positions % size
        on_device = homes >= 0
        shape = (end - start, *self.host_k.shape[1:])
        keys, values = torch.empty(shape, dtype=self.host_k.dtype), torch.empty(shape, dtype=self.host_v.dtype)
        device_slots = (homes[on_device] * size + within[on_device]).to(self.runner.device)
        keys[on_device] = self.runner.k_cache[layer, device_slots].cpu()
        values[on_device] = self.runner.v_cache[layer, device_slots].cpu()
        host_slots = (-homes[~on_device] - 1) * size + within[~on_device]
        keys[~on_device], values[~on_device] = self.host_k[host_slots], self.host_v[host_slots]
        return keys, values

    # ---------------------------------------------------------------- the layer pipeline

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, steps: list[SequenceStep], rows: torch.Tensor,
                on_layer: LayerHook | None = None, decoding: bool = False) -> torch.Tensor:
        """Every layer in turn, layer l + 1's host blocks loading and layer l - 1's new KV going home meanwhile."""
        self.apply_moves(self.pool.take_moves())
        model, num_layers = self.runner.model, self.runner.config.num_layers
        plans = [self.plan(layer, steps) for layer in range(num_layers)]
        for move in self.pool.take_inbound():
            plans[move.layer].inbound.append(move)
        self._ensure_scratch(sum(len(step.blocks) for step in steps) * self.block_size)
        loads = {0: self._load(plans[0])}
        x = model.embed_tokens(ids)
        for layer, block in enumerate(model.layers):
            if layer + 1 < num_layers:
                loads[layer + 1] = self._load(plans[layer + 1])
            if loads[layer] is not None:
                self.copier.wait(loads.pop(layer))
            batch, k_cache, v_cache = self.attention(plans[layer], steps, decoding)
            x, keys, values = block(x, batch, model.rotary, k_cache, v_cache)
            if plans[layer].scratch is not None:
                self.copier.submit(self._store, plans[layer])
            if on_layer is not None:
                on_layer(layer, keys, values)
        logits = model.lm_head(model.norm(x[rows])).float()
        self.finish()
        return logits

    def finish(self) -> None:
        """Wait for the step's copies; on CUDA scatter what came back into the host blocks."""
        self.copier.drain()
        for keys, values, slots, _ in self.host_writes:
            self.host_k.index_copy_(0, slots, keys)
            self.host_v.index_copy_(0, slots, values)
        self.host_writes = []

    def _load(self, plan: LayerPlan) -> Any:
        """Queue the layer's copies in; even with none, the layer waits for this (its scratch buffer is free
        only once the write-back of the layer that used it before is done, which the queue orders first)."""
        if plan.scratch is None and not plan.inbound:
            return None
        return self.copier.submit(self._copy_in, plan)

    # ---------------------------------------------------------------- planning

    def plan(self, layer: int, steps: list[SequenceStep]) -> LayerPlan:
        """Where layer `layer` reads: in place when every block of the step is on the device, else a scratch
        buffer with the copies that fill it and send the new tokens home."""
        homes = [self.pool.layer_table(step.blocks, layer) for step in steps]
        if all(home >= 0 for table in homes for home in table):
            return LayerPlan(layer, homes, None, Copies())
        tables, parts, offset = [], [], 0
        for step, table in zip(steps, homes):
            tables.append(list(range(offset, offset + len(table))))
            parts.append(self._sequence_copies(step, torch.tensor(table, dtype=torch.long), offset))
            offset += len(table)
        return LayerPlan(layer, tables, layer % SCRATCH_BUFFERS, _joined(parts))

    def _sequence_copies(self, step: SequenceStep, homes: torch.Tensor, offset: int) -> list[tuple[str, Any, Any]]:
        """(kind, source slots, target slots) of one sequence: its blocks before `start` into scratch
        blocks offset.., its new positions from scratch to their homes."""
        size = self.block_size
        loaded = homes[:-(-step.start // size)]
        scratch_blocks = torch.arange(offset, offset + loaded.numel())
        on_device = loaded >= 0
        copies: list[tuple[str, Any, Any]] = [
            ("device_in", block_slots(loaded[on_device].tolist(), size), block_slots(
                scratch_blocks[on_device].tolist(), size)),
            ("host_in", block_slots((-loaded[~on_device] - 1).tolist(), size), block_slots(
                scratch_blocks[~on_device].tolist(), size))]
        positions = torch.arange(step.start, step.end)
        index, within = positions // size, positions % size
        home = homes[index]
        scratch_slots = (offset + index) * size + within
        device = home >= 0
        copies.append(("device_out", scratch_slots[device], home[device] * size + within[device]))
        copies.append(("host_out", scratch_slots[~device], (-home[~device] - 1) * size + within[~device]))
        return copies

    def _ensure_scratch(self, slots: int) -> None:
        config = self.runner.config
        if self.scratch and self.scratch[0][0].shape[0] >= slots:
            return
        shape = (max(slots, self.block_size), config.num_kv_heads, config.head_dim)
        # Zeros, not empty: a masked slot still enters attention's matmul, and 0 × NaN would poison it.
        make = lambda: torch.zeros(shape, dtype=self.runner.dtype, device=self.runner.device)  # noqa: E731
        self.scratch = [(make(), make()) for _ in range(SCRATCH_BUFFERS)]

    # ---------------------------------------------------------------- attention over a plan

    def attention(self, plan: LayerPlan, steps: list[SequenceStep],
                  decoding: bool) -> tuple[AttentionBatch, torch.Tensor, torch.Tensor]:
        """The layer's batch over its tables (the runner's prefill or decode layout) and the cache tensors it
        reads and writes."""
        if plan.scratch is None:
            k_cache, v_cache = self.runner.k_cache[plan.layer], self.runner.v_cache[plan.layer]
        else:
            k_cache, v_cache = self.scratch[plan.scratch]
        if not decoding:
            return self._prefill_batch(steps[0], plan.tables[0]), k_cache, v_cache
        return self._decode_batch(steps, plan.tables), k_cache, v_cache

    def _prefill_batch(self, step: SequenceStep, table: list[int]) -> AttentionBatch:
        device, config = self.runner.device, self.runner.config
        context = slots_of(table, 0, step.end, self.block_size).to(device)
        sequence = SequenceSlice(0, step.end - step.start, context, step.start, config.sliding_window)
        return AttentionBatch(torch.arange(step.start, step.end, device=device), context[step.start:], [sequence],
                              kernels=self.runner.kernels)

    def _decode_batch(self, steps: list[SequenceStep], tables: list[list[int]]) -> AttentionBatch:
        device = self.runner.device
        positions = [step.start for step in steps]
        padded = padded_decode(positions, tables, self.block_size, self.runner.config.sliding_window, device)
        return AttentionBatch(torch.tensor(positions, device=device), padded.write.to(device), padded=padded,
                              block_size=self.block_size, kernels=self.runner.kernels)

    # ---------------------------------------------------------------- the copies

    def _copy_in(self, plan: LayerPlan) -> None:
        """Bring the layer's reloaded blocks home, then fill the plan's scratch buffer with the context its
        sequences had before this step."""
        started = time.perf_counter()
        k_scratch, v_scratch = self.scratch[plan.scratch or 0]
        device = self.runner.device
        if plan.inbound:
            source = block_slots([move.host_block for move in plan.inbound], self.block_size)
            target = block_slots([move.device_block for move in plan.inbound], self.block_size).to(device)
            for cache, host in ((self.runner.k_cache, self.host_k), (self.runner.v_cache, self.host_v)):
                values = host.index_select(0, source)
                if device.type == "cuda":
                    values = values.pin_memory()
                cache[plan.layer].index_copy_(0, target, values.to(device, non_blocking=True))
            self._count("layerkv_bytes_to_device", source.numel(), started)
        if plan.copies.device_in is not None:
            source, target = (t.to(device) for t in plan.copies.device_in)
            k_scratch.index_copy_(0, target, self.runner.k_cache[plan.layer].index_select(0, source))
            v_scratch.index_copy_(0, target, self.runner.v_cache[plan.layer].index_select(0, source))
        if plan.copies.host_in is not None:
            source, target = plan.copies.host_in
            keys, values = self.host_k.index_select(0, source), self.host_v.index_select(0, source)
            if device.type == "cuda":
                keys, values = keys.pin_memory(), values.pin_memory()
            target = target.to(device)
            k_scratch.index_copy_(0, target, keys.to(device, non_blocking=True))
            v_scratch.index_copy_(0, target, values.to(device, non_blocking=True))
            self._count("layerkv_bytes_to_device", source.numel(), started)
            self.stats["layerkv_layers_reloaded"] += 1

    def _store(self, plan: LayerPlan) -> None:
        """Send the step's new KV of this layer from the scratch buffer to its homes (the offload)."""
        started = time.perf_counter()
        k_scratch, v_scratch = self.scratch[plan.scratch or 0]
        device = self.runner.device
        if plan.copies.device_out is not None:
            source, target = (t.to(device) for t in plan.copies.device_out)
            self.runner.k_cache[plan.layer].index_copy_(0, target, k_scratch.index_select(0, source))
            self.runner.v_cache[plan.layer].index_copy_(0, target, v_scratch.index_select(0, source))
        if plan.copies.host_out is not None:
            source, target = plan.copies.host_out
            keys = k_scratch.index_select(0, source.to(device))
            values = v_scratch.index_select(0, source.to(device))
            if device.type == "cuda":
                pinned = [torch.empty(keys.shape, dtype=keys.dtype, pin_memory=True) for _ in range(2)]
                pinned[0].copy_(keys, non_blocking=True)
                pinned[1].copy_(values, non_blocking=True)
                self.host_writes.append((pinned[0], pinned[1], target, source))
            else:
                self.host_k.index_copy_(0, target, keys)
                self.host_v.index_copy_(0, target, values)
            self._count("layerkv_bytes_to_host", source.numel(), started)
            self.stats["layerkv_layers_stored"] += 1

    def apply_moves(self, moves: list[Move]) -> None:
        """Copy offloaded device layer blocks to their host blocks (before anything reuses the device blocks)."""
        if not moves:
            return
        started = time.perf_counter()
        for layer in {move.layer for move in moves}:
            mine = [move for move in moves if move.layer == layer]
            source = block_slots([move.device_block for move in mine], self.block_size).to(self.runner.device)
            target = block_slots([move.host_block for move in mine], self.block_size)
            self.host_k.index_copy_(0, target, self.runner.k_cache[layer].index_select(0, source).cpu())
            self.host_v.index_copy_(0, target, self.runner.v_cache[layer].index_select(0, source).cpu())
        self._count("layerkv_bytes_to_host", len(moves) * self.block_size, started)

    def _count(self, stat: str, tokens: int, started: float) -> None:
        """Bytes moved, and the copy bandwidth they show (on CUDA the copies are queued, not timed: the
        bandwidth is the probe's)."""
        moved = tokens * self.token_bytes
        self.stats[stat] += moved
        seconds = time.perf_counter() - started
        self.stats["layerkv_copy_s"] += seconds
        if self.runner.device.type != "cuda" and seconds > 0 and moved >= 1 << 20:
            self._observe_bandwidth(moved / seconds)

    def _observe_bandwidth(self, bps: float) -> None:
        self.bandwidth_bps = bps if self.bandwidth_bps <= 0 else \
            (1 - BANDWIDTH_WEIGHT) * self.bandwidth_bps + BANDWIDTH_WEIGHT * bps

    def probe_bandwidth(self, megabytes: int = 16) -> float:
        """Time one device-to-host copy of `megabytes` (the link eq. 4 needs), bytes per second."""
        source = torch.ones(megabytes << 18, dtype=torch.float32, device=self.runner.device)
        target = torch.empty(source.shape, dtype=source.dtype, pin_memory=self.runner.device.type == "cuda")
        target.copy_(source)  # warm up
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        started = time.perf_counter()
        target.copy_(source)
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        self._observe_bandwidth((megabytes << 20) / max(time.perf_counter() - started, 1e-9))
        return self.bandwidth_bps

    def close(self) -> None:
        self.copier.close()

    def detach(self) -> None:
        """The runner goes back to whole device blocks (a role change), and the copy worker stops."""
        self.runner.layered = None
        self.close()


def _joined(parts: list[list[tuple[str, Any, Any]]]) -> Copies:
    """One sequence's copies after another's, per kind; a kind with no slots at all is None."""
    copies = Copies()
    for kind in ("device_in", "host_in", "device_out", "host_out"):
        sources = [source for part in parts for name, source, _ in part if name == kind]
        targets = [target for part in parts for name, _, target in part if name == kind]
        source, target = torch.cat(sources), torch.cat(targets)
        if source.numel():
            setattr(copies, kind, (source, target))
    return copies
