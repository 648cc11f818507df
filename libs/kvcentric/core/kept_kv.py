"""What a decode instance keeps of a prompt whose KV push broke off (its prefill instance died mid-prompt): which
of the prompt's leading tokens arrived in every layer (`ReceivedKV`), and until when the blocks holding them stay
findable (`KeptBlocks`). It counts and remembers; it moves no bytes, frees no block and reads no clock.

The blocks themselves are the decode instance's paged-cache blocks. They are freed with the request as before,
but left findable by their chained block hashes (`BlockPool.cache`), as a prefix cache keeps freed blocks: a
prefill instance may pull them for the request's continuation (`engine/service/keptkv.py`) until an allocation
reuses them, they are handed over, or their time runs out. Nothing kept is ever referenced, so nothing kept can
leak; it is only the last room taken from.
"""

from __future__ import annotations

from collections.abc import Iterable


class ReceivedKV:
    """The token positions of one prompt's KV that arrived, per layer. Each layer's tokens usually come in order,
    chunk after chunk; with a push striped over several connections a later chunk of a layer may come first, and
    waits here until the gap before it is filled."""

    def __init__(self, num_layers: int) -> None:
        self.ends = [0] * num_layers
        """Per layer: tokens 0..end arrived."""
        self.ahead: list[dict[int, int]] = [{} for _ in range(num_layers)]
        """Per layer: ranges that arrived beyond a gap, start -> end."""

    def add(self, layer: int, start: int, end: int) -> None:
        """The KV of tokens start..end-1 of `layer` arrived."""
        ahead = self.ahead[layer]
        if start > self.ends[layer]:
            ahead[start] = max(end, ahead.get(start, 0))
            return
        reached = max(self.ends[layer], end)
        while ahead:
            joined = [s for s in ahead if s <= reached]
            if not joined:
                break
            for s in joined:
                reached = max(reached, ahead.pop(s))
        self.ends[layer] = reached

    @property
    def whole_tokens(self) -> int:
        """Leading tokens whose KV arrived in every layer."""
        return min(self.ends, default=0)

    def whole_blocks(self, block_size: int) -> int:
        """Leading full blocks of `block_size` tokens whose KV arrived in every layer."""
        return self.whole_tokens // block_size


class KeptBlocks:
    """The hashes of the blocks kept after broken pushes, each until `keep_s` after it was kept (kept again, it
    runs from then)."""

    def __init__(self, keep_s: float) -> None:
        if keep_s < 0:
            raise ValueError("keep_s must not be negative")
        self.keep_s = keep_s
        self.until: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self.until)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.until

    def keep(self, block_hashes: Iterable[str], now: float) -> None:
        """These blocks are kept from `now`."""
        until = now + self.keep_s
        for block_hash in block_hashes:
            self.until[block_hash] = until

    def release(self, block_hashes: Iterable[str]) -> list[str]:
        """Forget these blocks (handed over, or reused); returns those that were kept."""
        return [block_hash for block_hash in block_hashes if self.until.pop(block_hash, None) is not None]

    def due(self, now: float) -> list[str]:
        """The blocks whose time ran out, forgotten."""
        late = [block_hash for block_hash, until in self.until.items() if until <= now]
        for block_hash in late:
            del self.until[block_hash]
        return late
