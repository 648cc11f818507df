"""The KV cache manager (`core/kv_cache.py`), pure and on its own: computed blocks are shared, not copied; an
allocation takes everything or nothing; frees during a step wait for its end; staging is bounded; per-layer homes
come from a LayerKV pool; and every allocate / share / stage sequence, freed, leaves the pool all free."""

from __future__ import annotations

import random

import pytest

from kvcentric.core.block_pool import BlockPool, OutOfBlocks
from kvcentric.core.kv_cache import KVCacheManager, OutOfStaging
from kvcentric.core.layerkv.pool import LayerBlockPool, host_home


def manager(num_blocks: int = 8, block_size: int = 4, staging_bytes: int = 0) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, block_size), staging_bytes)


def test_computed_blocks_are_the_cached_prefix_up_to_the_limit_and_take_no_reference():
    kv = manager()
    blocks = kv.allocate(3)
    kv.cache(blocks, ["a", "b", "c"])
    kv.free(blocks)
    assert kv.computed_blocks(["a", "b", "x", "c"]) == blocks[:2]
    assert kv.computed_blocks(["a", "b", "c"], limit=1) == blocks[:1]
    assert kv.computed_blocks(["a"], limit=0) == []
    assert kv.num_free == kv.num_blocks


def test_allocate_shares_the_computed_blocks_and_counts_unreferenced_ones_against_the_free_list():
    kv = manager(num_blocks=4)
    first = kv.allocate(2)
    kv.cache(first, ["a", "b"])
    kv.free(first)  # both free again, findable by hash
    computed = kv.computed_blocks(["a", "b"])
    assert kv.can_allocate(2, computed) and not kv.can_allocate(3, computed)
    table = kv.allocate(2, computed)
    assert table[:2] == computed and len(set(table)) == 4 and kv.num_free == 0
    assert [kv.pool.ref_counts[block] for block in table] == [1, 1, 1, 1]


def test_an_allocation_that_does_not_fit_takes_nothing():
    kv = manager(num_blocks=4)
    held = kv.allocate(2)
    kv.cache(held, ["a", "b"])
    with pytest.raises(OutOfBlocks):
        kv.allocate(3, held)
    assert kv.num_free == 2 and [kv.pool.ref_counts[block] for block in held] == [1, 1]


def test_a_shared_block_is_free_only_after_every_holder_freed_it():
    kv = manager(num_blocks=2)
    blocks = kv.allocate(2)
    kv.share(blocks)
    kv.free(blocks)
    assert kv.num_free == 0
    kv.free(blocks)
    assert kv.idle


def test_blocks_freed_during_a_step_go_back_at_its_end():
    kv = manager(num_blocks=2)
    blocks = kv.allocate(2)
    kv.free_after_step(blocks)
    assert kv.num_free == 0 and not kv.idle
    kv.end_step()
    assert kv.idle


def test_staging_is_bounded_and_given_back():
    kv = manager(staging_bytes=100)
    kv.stage(60)
    assert kv.can_stage(40) and not kv.can_stage(41)
    with pytest.raises(OutOfStaging):
        kv.stage(41)
    assert kv.staging_used == 60
    with pytest.raises(ValueError):
        kv.unstage(61)
    kv.unstage(60)
    assert kv.idle


def test_layer_tables_are_the_blocks_themselves_without_per_layer_homes():
    kv = manager()
    blocks = kv.allocate(2)
    assert kv.layers is None and kv.layer_table(blocks, 3) == blocks


def test_layer_tables_come_from_a_layerkv_pool():
    pool = LayerBlockPool(device_blocks=2, block_size=4, num_layers=2, host_blocks=4)
    kv = KVCacheManager(pool)
    pool.placement = [0]  # layer 0 on the device, layer 1 on the host
    blocks = kv.allocate(2)
    assert kv.layers is pool
    assert all(home >= 0 for home in kv.layer_table(blocks, 0))
    assert sorted(kv.layer_table(blocks, 1)) == sorted(host_home(b) for b in range(2))


def _random_life(kv: KVCacheManager, rng: random.Random, steps: int) -> None:
    """Allocations (with computed blocks), shares, frees after a step, staging, in a seeded random order; every
    holder ends freed."""
    held: list[list[int]] = []
    staged: list[int] = []
    for _ in range(steps):
        action = rng.choice(["allocate", "share", "free", "free_after_step", "stage", "unstage", "end_step"])
        if action == "allocate":
            hashes = [f"h{rng.randrange(6)}" for _ in range(rng.randrange(1, 4))]
            computed = kv.computed_blocks(hashes, limit=rng.randrange(3))
            num_new = rng.randrange(0, 3)
            if kv.can_allocate(num_new, computed):
                table = kv.allocate(num_new, computed)
                kv.cache(table[len(computed):], [f"h{rng.randrange(6)}" for _ in table[len(computed):]])
                held.append(table)
            else:
                with pytest.raises(OutOfBlocks):
                    kv.allocate(num_new, computed)
        elif action == "share" and held:
            table = rng.choice(held)
            kv.share(table)
            held.append(list(table))
        elif action in ("free", "free_after_step") and held:
            table = held.pop(rng.randrange(len(held)))
            (kv.free if action == "free" else kv.free_after_step)(table)
        elif action == "stage" and kv.can_stage(10):
            kv.stage(10)
            staged.append(10)
        elif action == "unstage" and staged:
            kv.unstage(staged.pop())
        elif action == "end_step":
            kv.end_step()
    for table in held:
        kv.free(table)
    for size in staged:
        kv.unstage(size)
    kv.end_step()


@pytest.mark.parametrize("seed", range(20))
def test_any_sequence_of_allocations_freed_leaves_the_pool_all_free(seed):
    kv = manager(num_blocks=6, block_size=2, staging_bytes=30)
    _random_life(kv, random.Random(seed), steps=300)
    assert kv.idle
    assert all(count == 0 for count in kv.pool.ref_counts)


@pytest.mark.parametrize("seed", range(10))
def test_any_sequence_on_a_layerkv_pool_gives_every_layer_block_back(seed):
    pool = LayerBlockPool(device_blocks=4, block_size=2, num_layers=3, host_blocks=6)
    kv = KVCacheManager(pool, staging_bytes=20)
    _random_life(kv, random.Random(seed), steps=200)
    assert kv.idle
    assert pool.device_free_layer_blocks == pool.device_layer_blocks and len(pool.host_free) == pool.host_blocks
