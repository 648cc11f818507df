"""Blocks enter the host pool behind the compute: the next prefill runs while they are copied, the pool
announces a block only once its bytes are there, and a device block is never reused before its copy ends."""

import threading

import pytest
import torch

from factories import make_runner, prefill_job, prompt
from kvcentric.core.block_pool import BlockPool
from kvcentric.core.hashing import BlockHasher
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.cores.prefill import PrefillEngine


class GatedCopies:
    """Holds every block copy of `runner` until `open()` (as a slow device-to-host copy would)."""

    def __init__(self, runner) -> None:
        self.gate, self.started = threading.Event(), threading.Event()
        self.copy = runner.copy_blocks_to_host
        runner.copy_blocks_to_host = self.gated

    def gated(self, *args):
        self.started.set()
        assert self.gate.wait(10), "the copy was never let through"
        self.copy(*args)

    def open(self) -> None:
        self.gate.set()


def prefill(engine: PrefillEngine, job):
    engine.submit(job)
    chunk = engine.schedule()
    first = engine.execute(chunk)
    engine.update(chunk)
    engine.finish(chunk.work)
    return chunk.work, first


def make_engine(num_blocks=16, host_blocks=64):
    runner = make_runner(num_blocks=num_blocks, block_size=4)
    host = HostBlockPool(host_blocks, runner.block_bytes)
    # The whole-block write-behind of a finished prompt (a chunk's layer-wise store: test_layerwise_load.py)
    return PrefillEngine(runner, BlockPool(num_blocks, 4), BlockHasher(block_size=4), host=host,
                         layerwise_store=False), host


def test_blocks_are_announced_only_once_their_bytes_are_in_the_host_pool():
    engine, host = make_engine()
    gate = GatedCopies(engine.runner)
    work, _ = prefill(engine, prefill_job(prompt(21)))  # 5 full blocks
    assert gate.started.wait(5)
    assert len(host) == 0 and host.drain_events() == ([], [])  # reserved, not found, not announced
    assert not any(h in host for h in work.hashes) and host.prefix(work.hashes) == 0
    assert all(engine.pool.ref_counts[b] == 1 for b in work.blocks[:5])  # held while the copy runs
    gate.open()
    engine.writer.collect(wait=True)
    stored, _ = host.drain_events()
    assert stored == work.hashes and all(engine.pool.ref_counts[b] == 0 for b in work.blocks)
    expected = engine.runner.read_blocks(work.blocks[:5])
    for row, block_hash in enumerate(work.hashes):
        assert torch.equal(host.view(block_hash).view(expected.dtype).view(expected[row].shape), expected[row])


def test_the_next_prefill_does_not_wait_for_the_host_copy():
    engine, host = make_engine()
    gate = GatedCopies(engine.runner)
    prefill(engine, prefill_job(prompt(21)))
    assert gate.started.wait(5)
    _, first = prefill(engine, prefill_job(prompt(13, offset=3)))  # computed while the first copy is held
    reference, _ = make_engine()
    assert first == prefill(reference, prefill_job(prompt(13, offset=3)))[1]
    assert engine.writer.busy and len(host) == 0
    gate.open()
    engine.writer.collect(wait=True)
    assert len(host) == 5 + 3


def test_a_device_block_in_copy_is_waited_for_not_reused():
    engine, host = make_engine(num_blocks=8)
    gate = GatedCopies(engine.runner)
    first, _ = prefill(engine, prefill_job(prompt(21)))  # 6 of 8 blocks, 5 held by the copy
    assert gate.started.wait(5)
    threading.Timer(0.3, gate.open).start()
    second, _ = prefill(engine, prefill_job([9] * 28))  # needs 7 blocks: only once the copy let them go
    assert engine.writer.stats["host_write_waits"] >= 1
    engine.writer.collect(wait=True)
    assert host.prefix(first.hashes) == 5  # the first prompt's bytes reached the pool intact
    _, again = prefill(engine, prefill_job(prompt(21)))
    assert engine.stats["prefill_tokens_from_host"] > 0
    reference, _ = make_engine()
    assert again == prefill(reference, prefill_job(prompt(21)))[1]


def test_a_failed_copy_gives_its_slots_and_blocks_back():
    engine, host = make_engine()

    def broken(*args):
        raise RuntimeError("device lost")
    engine.runner.copy_blocks_to_host = broken
    work, _ = prefill(engine, prefill_job(prompt(21)))
    engine.writer.collect(wait=True)
    assert len(host) == 0 and not host.reserved and len(host.free_slots) == host.capacity
    assert engine.writer.stats["host_writes_failed"] == 5 and all(engine.pool.ref_counts[b] == 0 for b in work.blocks)


def test_a_reserved_slot_is_neither_found_nor_evicted_and_a_put_of_it_is_a_no_op():
    pool = HostBlockPool(2, 8)
    slot = pool.reserve("a", 0)
    assert slot is not None and "a" not in pool and not pool.wanted("a")
    assert pool.put("a", 0, b"\x01" * 8) is True and len(pool) == 0
    pool.put("b", 1, b"\x02" * 8)
    assert pool.put("c", 2, b"\x03" * 8) is True and "b" not in pool  # the reserved slot is not a victim
    with pytest.raises(ValueError):
        pool.reserve("a", 0)
    pool.buffer[slot].fill_(7)
    pool.commit(slot)
    assert pool.read("a") == b"\x07" * 8 and pool.drain_events() == (["b", "c", "a"], ["b"])
