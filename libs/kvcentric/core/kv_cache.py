"""One engine's KV cache bookkeeping over its block pool, the verbs every role allocates through: the computed
(prefix-hit) blocks a prompt can reuse, allocation with those shared, free (at once, or after the step in flight
that still reads the blocks), the prefix cache's hashes, host staging for KV that arrives at a full cache, and
each block's per-layer homes where the pool has them (LayerKV, `layerkv.pool.LayerBlockPool`).

Plain Python, no torch and no clock: it moves no bytes (the model runner does) and chooses no victim (a role's
scheduling policy does, e.g. decode's preemption of its newest request).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcentric.core.block_pool import BlockPool, OutOfBlocks
from kvcentric.core.layerkv.pool import LayerBlockPool


class OutOfStaging(RuntimeError):
    """Raised by `stage` when the host staging area has no room for the bytes asked for."""


class KVCacheManager:
    def __init__(self, pool: BlockPool, staging_bytes: int = 0) -> None:
        """`staging_bytes` bounds the host memory that KV arriving at a full cache may wait in (0: none)."""
        if staging_bytes < 0:
            raise ValueError("staging_bytes must not be negative")
        self.pool = pool
        self.staging_bytes, self.staging_used = staging_bytes, 0
        self._after_step: list[int] = []
        """Blocks freed while the step in flight still reads or writes them: they go back at `end_step`."""

    # ---------------------------------------------------------------- capacity

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return self.pool.blocks_for(num_tokens)

    # ---------------------------------------------------------------- computed blocks

    def computed_blocks(self, hashes: list[str], limit: int | None = None) -> list[int]:
        """The blocks holding the longest cached prefix of `hashes`, at most `limit` of them (no reference
        taken: `allocate` shares them)."""
        cached = self.pool.cached_prefix(hashes)
        return cached if limit is None else cached[:max(0, limit)]

    def cache(self, blocks: list[int], hashes: list[str]) -> None:
        """Full blocks findable by hash from now on (blocks[i] holds the block hashed hashes[i])."""
        self.pool.cache(blocks, hashes)

    def uncache(self, blocks: list[int]) -> None:
        """Blocks no longer findable (their bytes never arrived); announced as evicted."""
        self.pool.uncache(blocks)

    # ---------------------------------------------------------------- allocate and free

    def can_allocate(self, num_new: int, computed: Sequence[int] = ()) -> bool:
        """Whether `num_new` blocks can be allocated once the `computed` ones are shared: those nobody references
        leave the free list when shared, so they count against it."""
        reclaimed = sum(self.pool.ref_counts[block] == 0 for block in computed)
        return self.pool.can_allocate(num_new + reclaimed)

    def allocate(self, num_new: int, computed: Sequence[int] = ()) -> list[int]:
        """A block table: the `computed` blocks shared (a reference each), then `num_new` fresh ones. Takes
        nothing when it cannot take everything (`OutOfBlocks`)."""
        if not self.can_allocate(num_new, computed):
            raise OutOfBlocks(f"need {num_new} KV blocks besides {len(computed)} computed, "
                              f"{self.pool.num_free} free")
        shared = list(computed)
        self.pool.share(shared)
        return shared + self.pool.allocate(num_new)

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference on blocks already held (another holder of the same KV: a sibling sequence, the
        decode side of a colocated prompt, a copy in flight); each needs its own `free`."""
        self.pool.share(list(blocks))

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; a block nobody references is free again (a hashed one stays findable
        until it is reused)."""
        self.pool.free(list(blocks))

    def free_after_step(self, blocks: Sequence[int]) -> None:
        """`free`, at the end of the step in flight (`end_step`), which still reads or writes these blocks."""
        self._after_step += blocks

    def end_step(self) -> None:
        """The step in flight ended (computed or failed): the blocks freed during it go back."""
        after, self._after_step = self._after_step, []
        self.pool.free(after)

    # ---------------------------------------------------------------- host staging

    def can_stage(self, num_bytes: int) -> bool:
        """Host staging has room for `num_bytes` more."""
        return self.staging_used + num_bytes <= self.staging_bytes

    def stage(self, num_bytes: int) -> None:
        """Reserve `num_bytes` of host staging (KV that waits there for blocks); `unstage` gives them back."""
        if not self.can_stage(num_bytes):
            raise OutOfStaging(f"{num_bytes} bytes of host staging asked for, "
                               f"{self.staging_bytes - self.staging_used} of {self.staging_bytes} free")
        self.staging_used += num_bytes

    def unstage(self, num_bytes: int) -> None:
        if not 0 <= num_bytes <= self.staging_used:
            raise ValueError(f"{num_bytes} bytes unstaged, {self.staging_used} staged")
        self.staging_used -= num_bytes

    # ---------------------------------------------------------------- per-layer homes

    @property
    def layers(self) -> LayerBlockPool | None:
        """The pool's per-layer homes (LayerKV: each layer of a block on the device or the host), else None."""
        return self.pool if isinstance(self.pool, LayerBlockPool) else None

    def layer_table(self, blocks: list[int], layer: int) -> list[int]:
        """Where `blocks` live in one layer: device block ids, or host homes (`layerkv.pool.host_home`) with
        per-layer homes; without, every layer is on the device in the same blocks."""
        layers = self.layers
        return list(blocks) if layers is None else layers.layer_table(blocks, layer)

    # ---------------------------------------------------------------- checks

    @property
    def idle(self) -> bool:
        """Nothing held: every block free, no staging reserved, nothing waiting for the step's end (what every
        allocation's free leaves behind)."""
        return self.pool.num_free == self.pool.num_blocks and self.staging_used == 0 and not self._after_step
