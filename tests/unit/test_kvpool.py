import pytest
import torch

from factories import make_pool, make_runner, prefill_job, prompt
from kvcentric.core.block_pool import BlockPool
from kvcentric.engine.cores.prefill import PrefillEngine
from kvcentric.core.hashing import BlockHasher
from kvcentric.engine.kv.kvpool import HostBlockPool


def block(value: int, size: int = 8) -> bytes:
    return bytes([value]) * size


def test_the_pool_never_holds_more_than_its_capacity_and_evicts_lru_first():
    pool = HostBlockPool(2, 8, "lru")
    pool.put("a", 0, block(1))
    pool.put("b", 1, block(2))
    pool.read("a")  # a is now the most recent
    pool.put("c", 2, block(3))
    assert len(pool) == 2 and "b" not in pool and pool.read("a") == block(1) and pool.read("c") == block(3)
    assert pool.drain_events() == (["a", "b", "c"], ["b"])


def test_pinned_blocks_are_not_evicted():
    pool = HostBlockPool(1, 8)
    pool.put("a", 0, block(1))
    pool.pin("a")
    assert pool.put("b", 0, block(2)) is False and "a" in pool
    pool.unpin("a")
    assert pool.put("b", 0, block(2)) is True and "a" not in pool


def test_a_block_of_the_wrong_size_is_refused_and_its_slot_kept():
    pool = HostBlockPool(1, 8)
    with pytest.raises(ValueError):
        pool.put("a", 0, block(1, 7))
    assert pool.put("b", 0, block(2))


@pytest.mark.parametrize("policy", ["lru", "lfu", "length_aware"])
def test_every_policy_keeps_the_capacity(policy):
    pool = HostBlockPool(3, 8, policy)
    for i in range(10):
        pool.put(f"h{i}", i % 4, block(i))
        assert len(pool) <= 3
    assert pool.prefix(["h9", "h8"]) == 2 or len(pool) == 3


def test_prefill_loads_a_prefix_evicted_from_the_cache_back_from_the_host_pool():
    runner = make_runner(num_blocks=8, block_size=4)
    host = HostBlockPool(64, runner.block_bytes)
    engine = PrefillEngine(runner, BlockPool(8, 4), BlockHasher(block_size=4), host=host)
    firsts = []
    for job in (prefill_job(prompt(21)), prefill_job([9] * 28), prefill_job(prompt(21))):  # the 2nd evicts the 1st
        engine.submit(job)
        chunk = engine.schedule()
        firsts.append(engine.execute(chunk))
        engine.update(chunk)
        engine.finish(chunk.work)
    # The second prompt evicted the first one's last 4 full blocks from the cache (freed last-first, so
    # the deepest go first); block 0 is still cached, blocks 1-4 come back from the host pool.
    assert engine.stats["prefill_tokens_cached"] == 20 and engine.stats["prefill_tokens_from_host"] == 16
    assert engine.stats["prefill_tokens_computed"] == 21 + 28 + 1
    assert firsts[0] == firsts[2]
    reference = make_runner(block_size=4)
    blocks = make_pool(reference).allocate(6)
    assert firsts[2] == int(torch.argmax(reference.prefill(prompt(21), blocks, 0)))
