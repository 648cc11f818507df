"""The model's input beside its tokens: the positions and cache addressing of one step (`AttentionBatch`): each
prompt's slice and the slots it attends to (`SequenceSlice`), the decode rows laid out for one call
(`PaddedRows`). A layer's cache is [slots, kv_heads, head_dim] with slot = block * block_size + offset. It
addresses the cache; it allocates no blocks (`core/block_pool.py`) and computes no attention (`llama.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, TypeGuard

import torch

from kvcentric.engine.model.ops import AttentionKernels


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """[batch, kv_heads, blocks * block_size, head_dim] from a [slots, kv_heads, head_dim] cache, copying
    whole blocks (contiguous runs) rather than single slots."""
    by_block = cache.view(-1, block_size, *cache.shape[1:])
    batch, count = blocks.shape
    return by_block[blocks].view(batch, count * block_size, *cache.shape[1:]).transpose(1, 2)


class SequenceSlice:
    """One sequence of a prefill batch: its rows in the flat token batch and the slots it attends to."""

    def __init__(self, start: int, end: int, context_slots: torch.Tensor, first_position: int,
                 sliding_window: int | None = None) -> None:
        self.start, self.end, self.context_slots = start, end, context_slots
        new, context = end - start, context_slots.shape[0]
        self.causal = first_position == 0 and new == context and not _window_applies(sliding_window, context)
        self.fresh = self.causal
        """A whole prompt with nothing cached: it attends to its own new keys and values (no cache read)."""
        self.mask = None
        if not self.causal:
            query_pos = torch.arange(first_position, first_position + new, device=context_slots.device).unsqueeze(1)
            key_pos = torch.arange(context, device=context_slots.device).unsqueeze(0)
            self.mask = key_pos <= query_pos
            if _window_applies(sliding_window, context):
                self.mask &= key_pos > query_pos - sliding_window


def fresh_runs(sequences: Sequence[SequenceSlice]) -> list[list[SequenceSlice]]:
    """The fresh sequences (`SequenceSlice.fresh`) in runs of adjacent rows and equal lengths."""
    runs: list[list[SequenceSlice]] = []
    for seq in sequences:
        if not seq.fresh:
            continue
        last = runs[-1][-1] if runs else None
        if last is not None and last.end == seq.start and last.end - last.start == seq.end - seq.start:
            runs[-1].append(seq)
        else:
            runs.append([seq])
    return runs


def _window_applies(window: int | None, context: int) -> TypeGuard[int]:
    return window is not None and context > window


class PaddedRows(NamedTuple):
    """Decode rows (one new token each) laid out for one attention call (`runner.padded_decode`)."""

    blocks: torch.Tensor
    """[batch, max_blocks] block tables, padded with block 0."""
    mask: torch.Tensor | None
    """[batch, 1, 1, max_blocks * block_size]: the positions each row attends to (None where the kernels always
    take the rows: CUDA graphs)."""
    lengths: torch.Tensor
    """[batch] context lengths, the new token included."""
    write: torch.Tensor
    """The slots their new tokens' KV goes to (on the host)."""


class AttentionBatch:
    """Flattened new tokens with positions and cache addressing: per-sequence slices (prefill), and/or the
    `PaddedRows` of the rows from `padded_start` on (decode, one token per sequence; a mixed step puts them
    after the slices). With `kernels` the decode rows attend through them over the cache in place and
    whole prompts in one call; else (or where they decline) through SDPA, decode rows over a gathered copy."""

    def __init__(self, positions: torch.Tensor, write_slots: torch.Tensor, sequences: Sequence[SequenceSlice] = (),
                 padded: PaddedRows | None = None, block_size: int = 0, padded_start: int = 0,
                 kernels: AttentionKernels | None = None) -> None:
        self.positions, self.write_slots, self.sequences = positions, write_slots, sequences
        self.padded = padded
        self.block_size, self.padded_start = block_size, padded_start
        self.kernels = kernels
        self._fresh: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fresh_made = False
        self.rotation: tuple[torch.Tensor, torch.Tensor] | None = None
        """cos and sin of `positions` (first halves), made by the first layer's rotary and kept for the rest."""

    def fresh_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """First rows and lengths of the whole prompts (`SequenceSlice.fresh`), None without any; made once
        per batch and shared by every layer."""
        if not self._fresh_made:
            fresh = [seq for seq in self.sequences if seq.fresh]
            self._fresh = (torch.tensor([seq.start for seq in fresh]),
                           torch.tensor([seq.end - seq.start for seq in fresh])) if fresh else None
            self._fresh_made = True
        return self._fresh
