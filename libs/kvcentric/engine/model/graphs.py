"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured once over inputs that live
in fixed device buffers, so a step costs a few small copies and one launch instead of hundreds.

A decode step of a small model on a GPU is nearly all launch and Python overhead, far above its memory floor
(issue 14), and an 8B step's hundreds of launches cost as much again as its weight reads. A graph replays the
recorded kernels with no Python between them.

What a step varies lives in the buffers, each sized for the largest bucket: token ids, positions, the slots the
new KV goes to, context lengths and the [batch, max_blocks] block tables. A step of `n` sequences runs the
graph of the smallest bucket >= n; the rows past `n` are padding: position 0, length 1, table row 0, and their
KV goes to a spare slot (`scratch_slot`, a block the allocator never hands out), so a padding row never
overwrites a sequence's cache. The attention kernel reads lengths and tables from the device
(`kernels/paged.py`), so one graph serves every context length up to the model's longest.

Buckets are captured at load, largest first, into one memory pool (the smaller graphs reuse the larger's
activations), all writing their logits into one fp32 buffer of the largest bucket's rows (a graph's own output
would stay allocated: 90 MB for the 8B vocabulary at `--max-batch 64`, 1.1 GB at 256), after a warm-up run that
compiles the Triton kernel. A step larger than the largest bucket, or a sequence longer than the tables, runs
eagerly. Mixed steps (prompt chunks with decode rows) and LayerKV's per-layer tables stay eager.

Without `capture` (the CPU) the same buffers and padding run eagerly: what the tests check on a machine with
no GPU, through the CPU kernel, which reads the same tables and lengths.
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

import torch

from kvcentric.engine.model.batch import AttentionBatch, PaddedRows

if TYPE_CHECKING:
    from kvcentric.engine.model.runner import ModelRunner


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to `max_batch` (which is always the last): padding costs at most 15 rows of
    a big step, where a row is cheap (the weights are read once for the whole batch)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch]
    buckets += list(range(16, max_batch, 16))
    return sorted(set(buckets)) + [max_batch]


class DecodeGraphs:
    """The decode steps of one `ModelRunner` through fixed input buffers, replayed from CUDA graphs (`capture`)
    or run eagerly over the same buffers."""

    def __init__(self, runner: ModelRunner, max_batch: int, scratch_slot: int, capture: bool) -> None:
        self.runner = runner
        self.buckets = batch_buckets(max_batch)
        self.scratch_slot = scratch_slot
        self.capture = capture
        top, device = self.buckets[-1], runner.device
        self.width = math.ceil(runner.config.max_position / runner.block_size)
        """Block table entries per row: enough for the model's longest sequence."""
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.write = torch.full((top,), scratch_slot, dtype=torch.long, device=device)
        self.lengths = torch.ones(top, dtype=torch.long, device=device)
        self.tables = torch.zeros((top, self.width), dtype=torch.long, device=device)
        self.rows = torch.arange(top, device=device)
        self.logits = torch.empty((top, runner.config.vocab_size), dtype=torch.float32, device=device)
        """Every bucket's output: a step's logits are its first rows, valid until the next step."""
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            pool = torch.cuda.graph_pool_handle()
            for bucket in reversed(self.buckets):
                self.graphs[bucket] = self._capture(bucket, pool)

    def forward(self, bucket: int) -> torch.Tensor:
        """Logits [bucket, vocab] of the first `bucket` rows of the buffers."""
        runner = self.runner
        rows = PaddedRows(self.tables[:bucket], None, self.lengths[:bucket], self.write[:bucket])
        batch = AttentionBatch(self.positions[:bucket], self.write[:bucket], padded=rows,
                               block_size=runner.block_size, kernels=runner.kernels)
        return runner.model(self.ids[:bucket], batch, runner.k_cache, runner.v_cache, self.rows[:bucket],
                            out=self.logits[:bucket])

    def _capture(self, bucket: int, pool) -> torch.cuda.CUDAGraph:
        """One bucket's graph, recorded after a warm-up run on a side stream (Triton compiles there; the
        buffers hold padding rows, so both runs write only the spare slot)."""
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(side):
            self.forward(bucket)
        torch.cuda.current_stream(self.runner.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # other threads' CUDA calls
            self.forward(bucket)
        return graph

    def bucket(self, size: int) -> int | None:
        """The smallest bucket that holds `size` rows; None past the largest."""
        index = bisect.bisect_left(self.buckets, size)
        return self.buckets[index] if index < len(self.buckets) else None

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor | None:
        """Logits [len(token_ids), vocab] of one decode step, or None when it does not fit the buffers (the caller
        runs it eagerly)."""
        count, size = len(token_ids), self.runner.block_size
        bucket = self.bucket(count)
        used = [p // size + 1 for p in positions]
        if bucket is None or max(used) > self.width:
            return None
        pad = bucket - count
        writes = [table[p // size] * size + p % size for table, p in zip(block_tables, positions)]
        meta = torch.tensor([token_ids + [0] * pad, positions + [0] * pad, writes + [self.scratch_slot] * pad,
                             [p + 1 for p in positions] + [1] * pad], dtype=torch.long)
        width = max(used)
        tables = torch.tensor([table[:n] + [0] * (width - n) for table, n in zip(block_tables, used)]
                              + [[0] * width] * pad, dtype=torch.long)
        device = self.runner.device
        meta, tables = meta.to(device, non_blocking=True), tables.to(device, non_blocking=True)
        for buffer, values in zip((self.ids, self.positions, self.write, self.lengths), meta):
            buffer[:bucket].copy_(values)
        self.tables[:bucket, :width].copy_(tables)
        if not self.capture:
            return self.forward(bucket)[:count].clone()
        self.graphs[bucket].replay()
        return self.logits[:count].clone()  # the next step overwrites the shared output
