import pytest

from kvcentric.core.block_pool import BlockPool, OutOfBlocks


def test_allocate_and_free_return_blocks_to_the_pool():
    pool = BlockPool(4, 16)
    blocks = pool.allocate(3)
    assert pool.num_free == 1 and len(set(blocks)) == 3
    pool.free(blocks)
    assert pool.num_free == 4


def test_allocate_more_than_free_raises_and_takes_nothing():
    pool = BlockPool(2, 16)
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)
    assert pool.num_free == 2


def test_double_free_is_an_error():
    pool = BlockPool(2, 16)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError):
        pool.free(blocks)


def test_cached_blocks_are_found_by_hash_after_free_and_shared_with_refcounts():
    pool = BlockPool(4, 16)
    blocks = pool.allocate(2)
    pool.cache(blocks, ["a", "b"])
    pool.free(blocks)
    assert pool.cached_prefix(["a", "b", "c"]) == blocks
    pool.share(blocks)
    assert pool.num_free == 2 and pool.ref_counts[blocks[0]] == 1
    pool.share(blocks)
    pool.free(blocks)
    pool.free(blocks)
    assert pool.num_free == 4
    assert pool.drain_events() == (["a", "b"], [])


def test_empty_blocks_are_reused_before_cached_ones_and_eviction_is_reported():
    pool = BlockPool(3, 16)
    cached = pool.allocate(1)
    pool.cache(cached, ["x"])
    pool.free(cached)
    pool.drain_events()
    first = pool.allocate(2)
    assert cached[0] not in first  # the two empty blocks go first
    assert pool.cached_prefix(["x"]) == cached
    pool.allocate(1)  # only the cached block is left: it is evicted
    assert pool.cached_prefix(["x"]) == []
    assert pool.drain_events() == ([], ["x"])


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(2, 16)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache(a, ["a"])
    pool.cache(b, ["b"])
    pool.free(a)
    pool.free(b)
    pool.allocate(1)
    assert pool.cached_prefix(["a"]) == [] and pool.cached_prefix(["b"]) == b
