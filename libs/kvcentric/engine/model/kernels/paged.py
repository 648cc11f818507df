"""Decode attention over the paged KV cache on a GPU, in Triton: each sequence's keys and values are read where they
lie, through its block table, with no padded copy.

The cache of one layer is [slots, kv_heads, head_dim] with slot = block * block_size + offset (`llama.py`). One
program takes one sequence and one KV head with every query head of its group (grouped-query attention reads a
key tile once for the whole group): it walks the sequence's positions in tiles of `TILE` keys, looks each
position's block up in the table, and keeps an online softmax (running max, running sum, rescaled accumulator),
so the scores never go to memory. The group's query rows are padded to 16, the smallest tile `tl.dot` takes.
A small batch has too few (sequence, KV head) pairs to keep the GPU's SMs reading (batch 1 of an 8-KV-head model:
8 programs), so there each sequence's tiles are shared among `splits_for` programs, each keeping its own max,
sum and output, and a second small kernel weighs the shares together (the split of flash-decoding).

Everything the launch depends on is a tensor on the device or a constant of the model (no host value of a
step), so a decode step that calls it can be captured in a CUDA graph and replayed (`engine/model/graphs.py`):
lengths and block tables are read by the kernel, and the loop over a sequence's tiles ends at its own length.

fp32 inputs multiply in IEEE fp32 (no TF32), so a CUDA fp32 engine keeps fp32 logits; bf16 and fp16 multiply in
their own type on the tensor cores with fp32 accumulation. `TRITON_INTERPRET=1` runs it on the CPU (its tests do).

Prefill stays with torch's SDPA on the GPU (flash attention already reads each prompt once); `prefill` declines.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

TILE = 64
"""Keys per tile of the walk over a sequence (a multiple of 16)."""
PROGRAMS = 256
"""Programs a decode launch aims for: about two per SM of an H100 (132), so a small batch still reads its keys
with the whole GPU."""
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's CPU interpreter multiplies bf16 tiles wrongly in `tl.dot` (seen with triton 3.9: products off by
1e10): there the tiles go to fp32 first, which gives the GPU's sums (bf16 products are exact in fp32)."""


@triton.jit
def _paged_decode(q_ptr, k_ptr, v_ptr, out_ptr, best_ptr, total_ptr, tables_ptr, lengths_ptr, scale,
                  q_row, q_head, cache_slot, cache_head, table_row, out_row, out_head,
                  GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, WINDOW: tl.constexpr, SPLITS: tl.constexpr,
                  IEEE: tl.constexpr, UPCAST: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lengths_ptr + seq)
    rows = tl.arange(0, GROUP_ROWS)
    dims = tl.arange(0, DIM)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + seq * q_row + heads[:, None] * q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    first = 0
    if WINDOW > 0:  # the new token (position length - 1) sees positions > its own - window
        first = tl.maximum(length - WINDOW, 0)
    begin = (first // TILE) * TILE
    end = length
    if SPLITS > 1:  # this program's share of the tiles: a whole number of them, the last share may be short
        share = tl.cdiv(tl.cdiv(length - begin, TILE), SPLITS) * TILE
        begin = begin + split * share
        end = tl.minimum(begin + share, length)
    best = tl.full((GROUP_ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_ROWS,), tl.float32)
    acc = tl.zeros((GROUP_ROWS, DIM), tl.float32)
    table = tables_ptr + seq.to(tl.int64) * table_row
    for start in range(begin, end, TILE):
        positions = start + tl.arange(0, TILE)
        live = (positions < end) & (positions >= first)
        blocks = tl.load(table + positions // BLOCK_SIZE, mask=live, other=0)
        slots = blocks.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
        where = slots[:, None] * cache_slot + kv_head * cache_head + dims[None, :]
        both = live[:, None] & dim_ok[None, :]
        keys = tl.load(k_ptr + where, mask=both, other=0.0)
        if UPCAST:
            keys = keys.to(tl.float32)
        if IEEE or UPCAST:
            scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(keys))
        scores = tl.where(live[None, :], scores * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        weights = tl.exp(scores - new_best[:, None])
        rescale = tl.exp(best - new_best)
        total = total * rescale + tl.sum(weights, 1)
        values = tl.load(v_ptr + where, mask=both, other=0.0)
        if IEEE:
            acc = acc * rescale[:, None] + tl.dot(weights, values, input_precision="ieee")
        elif UPCAST:  # the GPU's arithmetic: weights rounded to the cache's type, products exact in fp32
            acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype).to(tl.float32), values.to(tl.float32),
                                                  input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(weights.to(values.dtype), values)
        best = new_best
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # an empty share (a short sequence) stays finite
    if SPLITS > 1:  # partial results, [batch, heads, splits, ...] in fp32: `_merge_splits` weighs them
        part = (seq * (GROUP * tl.num_programs(1)) + heads) * SPLITS + split
        tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(best_ptr + part, best, mask=row_ok)
        tl.store(total_ptr + part, total, mask=row_ok)
    else:
        tl.store(out_ptr + seq * out_row + heads[:, None] * out_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_splits(parts_ptr, best_ptr, total_ptr, out_ptr, out_row, out_head, HEAD_DIM: tl.constexpr,
                  DIM: tl.constexpr, SPLITS: tl.constexpr):
    """One head of one sequence: its shares' outputs weighed by exp(max - overall max) x sum (an empty share
    has max -inf and weighs nothing)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, DIM)
    part = (seq * tl.num_programs(1) + head) * SPLITS + splits
    best = tl.load(best_ptr + part)
    weight = tl.exp(best - tl.max(best, 0)) * tl.load(total_ptr + part)
    parts = tl.load(parts_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=dims[None, :] < HEAD_DIM, other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * out_row + head * out_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def splits_for(batch: int, kv_heads: int, programs: int = PROGRAMS) -> int:
    """Shares each sequence's context is cut into: enough programs to fill the GPU (`PROGRAMS`) when the batch
    alone does not (flash-decoding's split of the keys), a power of two up to 16; 1 for a full batch."""
    want = -(-programs // max(1, batch * kv_heads))
    return min(16, triton.next_power_of_2(want)) if want > 1 else 1


class PagedAttention:
    """The `ops.AttentionKernels` of a CUDA engine: paged decode in Triton; prompts stay with SDPA."""

    def __init__(self, splits: int | None = None) -> None:
        self.splits = splits
        """Shares of each sequence's context (a power of two); None: `splits_for` the batch."""

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
               lengths: torch.Tensor, block_size: int, window: int | None = None) -> torch.Tensor | None:
        """q: [batch, heads, head_dim]; k_cache, v_cache: [slots, kv_heads, head_dim] (one layer); tables:
        [batch, max_blocks]; lengths: [batch], the new token's KV already in the cache. [batch, heads, head_dim]."""
        batch, heads, head_dim = q.shape
        kv_heads = k_cache.shape[1]
        if (heads % kv_heads or k_cache.stride(2) != 1 or q.stride(2) != 1 or tables.stride(1) != 1
                or v_cache.stride() != k_cache.stride()):
            return None
        group, dim = heads // kv_heads, max(16, triton.next_power_of_2(head_dim))
        splits = self.splits if self.splits is not None else splits_for(batch, kv_heads)
        out = torch.empty_like(q)
        target, best, total = out, out, out
        if splits > 1:
            target = torch.empty((batch, heads, splits, head_dim), dtype=torch.float32, device=q.device)
            best = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
            total = torch.empty_like(best)
        _paged_decode[(batch, kv_heads, splits)](
            q, k_cache, v_cache, target, best, total, tables, lengths, head_dim ** -0.5,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.stride(0),
            out.stride(0), out.stride(1),
            GROUP=group, GROUP_ROWS=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DIM=dim,
            BLOCK_SIZE=block_size, TILE=TILE, WINDOW=window or 0, SPLITS=splits,
            IEEE=q.dtype == torch.float32, UPCAST=INTERPRETED and q.dtype != torch.float32)
        if splits > 1:
            _merge_splits[(batch, heads)](target, best, total, out, out.stride(0), out.stride(1),
                                          HEAD_DIM=head_dim, DIM=dim, SPLITS=splits)
        return out

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, starts: torch.Tensor,
                lengths: torch.Tensor) -> bool:
        return False


def load() -> PagedAttention:
    return PagedAttention()
