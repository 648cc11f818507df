"""KV write-back from a decode instance: each block that a request's generated tokens fill goes, once full, into
the host pool of the prefill instance that pushed the request's prompt (`KVHeader.pool_addr`), which announces
it like any block it holds. A request migrated after its decode instance dies then finds its prompt and its
output there, and computes only what followed the last full block (`kvcentric.core.migration`).

`OutputBlocks` says which blocks a step filled and reads them (in the model thread); `WriteBack` sends them
(in the event loop). Neither decides where a request goes; a block that cannot be sent is dropped (counted):
it would only have spared a migrated request some compute.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Sequence

import torch

from kvcentric.core.hashing import BlockHasher, to_hex
from kvcentric.engine.cores.sequence import DecodeRequest
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.runtime.transfer import KVPusher, TransferError, put_blocks

MAX_PENDING_BYTES = 64 << 20
"""Bytes of blocks waiting for one pool at most; newer ones are dropped while it lags (a chain's start is what
a continuation can use)."""


@dataclasses.dataclass(frozen=True)
class FilledBlock:
    """One full block of a request's KV, on its way to `addr`'s pool."""

    addr: str
    block_hash: str
    depth: int
    """Its index in the request's sequence."""
    data: bytes
    """Host-pool layout: [num_layers, 2 (key, value), block_size, kv heads, head dim]."""


class OutputBlocks:
    """The blocks a decode step filled, with the chained hashes a prefill gives the same tokens."""

    def __init__(self, runner: ModelRunner, hasher: BlockHasher) -> None:
        if hasher.block_size != runner.block_size:
            raise ValueError("the hasher's block size must equal the cache's")
        if runner.layered is not None:
            raise ValueError("a LayerKV cache has no whole blocks to write back")
        self.runner, self.hasher, self.block_size = runner, hasher, runner.block_size
        self.last: dict[str, tuple[int, bytes]] = {}
        """Request key -> (index, hash) of the block it filled last: the next one's parent."""

    def filled_by(self, request: DecodeRequest) -> int | None:
        """The index of the block whose last position the step just wrote (its input token's), if any, for a
        request whose pool is known."""
        position = request.position
        if not request.pool_addr or len(request.prompt) != request.job.n_prompt_tokens or \
                (position + 1) % self.block_size:
            return None
        return position // self.block_size

    def collect(self, batch: Sequence[DecodeRequest]) -> list[FilledBlock]:
        """After a step, before its tokens are recorded (the model thread): the blocks it filled, read out."""
        self.last = {r.key: self.last[r.key] for r in batch if r.key in self.last}
        return [FilledBlock(r.pool_addr, to_hex(self.block_hash(r, index)), index, self.read(r.blocks[index]))
                for r in batch if (index := self.filled_by(r)) is not None]

    def read(self, block: int) -> bytes:
        return read_block(self.runner, block)

    def block_hash(self, request: DecodeRequest, index: int) -> bytes:
        """The chained hash of block `index` of the request's tokens (prompt, then those generated)."""
        tokens = [*request.prompt, *request.generated]
        size = self.block_size
        last = self.last.get(request.key)
        if last is not None and last[0] == index - 1:
            parent = last[1]
        else:
            chain = self.hasher.hash_blocks(tokens[:index * size])
            parent = chain[-1] if chain else self.hasher.root
        block_hash = self.hasher.hash_block(parent, tokens[index * size:(index + 1) * size])
        self.last[request.key] = (index, block_hash)
        return block_hash


def read_block(runner: ModelRunner, block: int) -> bytes:
    """One cache block's bytes in host-pool layout: its slots are contiguous in every layer, so one copy (a fifth
    of the time `ModelRunner.read_blocks` takes for one block)."""
    start = block * runner.block_size
    end = start + runner.block_size
    data = torch.stack((runner.k_cache[:, start:end], runner.v_cache[:, start:end]), dim=1)
    return data.cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


class WriteBack:
    """Sends filled blocks to their pools: one stream at a time per pool, each with every block queued for it."""

    def __init__(self, pusher: KVPusher, counters: collections.Counter[str]) -> None:
        self.pusher, self.counters = pusher, counters
        self.pending: dict[str, list[FilledBlock]] = {}
        self.pending_bytes: collections.Counter[str] = collections.Counter()
        self.sending: dict[str, asyncio.Task] = {}

    def send(self, blocks: Sequence[FilledBlock]) -> None:
        for block in blocks:
            if self.pending_bytes[block.addr] + len(block.data) > MAX_PENDING_BYTES:
                self.counters["kv_write_back_dropped_total"] += 1
                continue
            self.pending.setdefault(block.addr, []).append(block)
            self.pending_bytes[block.addr] += len(block.data)
            if block.addr not in self.sending:
                self.sending[block.addr] = asyncio.ensure_future(self._drain(block.addr))

    async def _drain(self, addr: str) -> None:
        """Send what is queued for `addr`, and what was queued meanwhile, until nothing is."""
        try:
            while blocks := self.pending.pop(addr, []):
                del self.pending_bytes[addr]
                try:
                    await put_blocks(self.pusher, addr, [(b.block_hash, b.depth, b.data) for b in blocks])
                    self.counters["kv_blocks_written_back_total"] += len(blocks)
                except TransferError:
                    self.counters["kv_write_back_failed_total"] += len(blocks)
        finally:
            del self.sending[addr]

    async def close(self) -> None:
        tasks = list(self.sending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
