"""The decode side of PrfaaS §3.3 (only the uncached part of a prompt's KV crosses datacenters): a decode
instance pulls the prompt's prefix blocks from the instance of its own cluster that caches them, while the
remote prefill pushes only the KV after that prefix, and writes the prefix into the request's cache blocks
layer by layer. It fetches and lays out bytes; it does not decide which prefix is local (the conductor does).

A pulled block is in host-pool layout: [num_layers, 2 (key, value), block_size, kv heads, head dim].
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

from kvcentric.runtime.transfer import KVPusher, fetch_blocks


def prefix_layers(blocks: Sequence[bytes], tokens: int, num_layers: int, block_size: int,
                  layer_token_bytes: int) -> Iterator[tuple[int, bytes, bytes]]:
    """(layer, key bytes, value bytes) of token positions 0..tokens-1, one per layer, cut from host-pool
    blocks (the last block may be used only in part)."""
    if not 0 < tokens <= len(blocks) * block_size:
        raise ValueError(f"{len(blocks)} blocks of {block_size} tokens cannot hold a prefix of {tokens} tokens")
    per_block = block_size * layer_token_bytes
    if any(len(block) != num_layers * 2 * per_block for block in blocks):
        raise ValueError(f"a prefix block is not {num_layers * 2 * per_block} bytes")
    for layer in range(num_layers):
        keys, values = [], []
        for index, block in enumerate(blocks):
            used = min(block_size, tokens - index * block_size) * layer_token_bytes
            if used <= 0:
                break
            base = layer * 2 * per_block
            keys.append(block[base:base + used])
            values.append(block[base + per_block:base + per_block + used])
        yield layer, b"".join(keys), b"".join(values)


class PrefixPulls:
    """The prefix pulls of the requests whose DecodeJob names a local source: each starts when the job
    arrives (beside the remote prefill) and is awaited when the request's KV begins to arrive."""

    def __init__(self, pusher: KVPusher, dtype: str, block_size: int) -> None:
        self.pusher, self.dtype, self.block_size = pusher, dtype, block_size
        self.pending: dict[str, tuple[asyncio.Task, int]] = {}

    def start(self, request_id: str, addr: str, block_hashes: list[str], tokens: int) -> None:
        task = asyncio.ensure_future(fetch_blocks(self.pusher, addr, block_hashes, self.dtype, self.block_size))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved even if never awaited
        self.pending[request_id] = (task, tokens)

    def expects(self, request_id: str) -> bool:
        return request_id in self.pending

    async def blocks(self, request_id: str) -> tuple[list[bytes], int]:
        """The pulled blocks and the prefix length in tokens (raises what the pull raised)."""
        task, tokens = self.pending[request_id]
        return await asyncio.shield(task), tokens

    def forget(self, request_id: str) -> None:
        entry = self.pending.pop(request_id, None)
        if entry is not None:
            entry[0].cancel()
