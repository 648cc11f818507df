"""KV write-back on the CPU, no servers (`engine/service/writeback.py`): the blocks a decode step fills carry the
hashes a prefill gives the same tokens and the KV it would compute, and a migrated request's continuation that finds
them in the prefill's host pool computes only its last partial block, then goes on with the same tokens."""

from __future__ import annotations

import time

import torch

from factories import decode_job, greedy, make_pool, make_runner, prefill_job, prompt
from kvcentric.core.hashing import BlockHasher, to_hex
from kvcentric.core.migration import continuation
from kvcentric.engine.cores.decode import DecodeEngine
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.model.local import generate
from kvcentric.engine.cores.prefill import PrefillEngine
from kvcentric.engine.model.runner import kv_payload
from kvcentric.engine.service.writeback import FilledBlock, OutputBlocks

BLOCK = 4
POOL = "127.0.0.1:1"


def prefill_engine() -> PrefillEngine:
    runner = make_runner(block_size=BLOCK)
    return PrefillEngine(runner, make_pool(runner), BlockHasher(block_size=BLOCK), chunk_tokens=8,
                         host=HostBlockPool(64, runner.block_bytes))


def served(prefill: PrefillEngine, token_ids: list[int], max_tokens: int,
           pool_addr: str = POOL) -> tuple[list[int], list[FilledBlock]]:
    """One request prefilled by `prefill` and decoded by a decode engine of its own, whose steps' filled blocks
    are collected as the decode service does: its tokens, and those blocks."""
    runner = make_runner(block_size=BLOCK)
    decode = DecodeEngine(runner, make_pool(runner))
    output = OutputBlocks(decode.runner, BlockHasher(block_size=BLOCK))
    job = prefill_job(token_ids, greedy(max_tokens))
    prefill.submit(job)
    decode.add(decode_job(job.request_id, len(token_ids), job.sampling), time.monotonic())
    decode.begin_kv(job.request_id, len(token_ids), decode.runner.config.num_layers, token_ids, pool_addr=pool_addr)
    first = None
    while (chunk := prefill.schedule()) is not None:
        def on_layer(layer, keys, values, start=chunk.start):
            key, value, _ = kv_payload(keys, values)
            decode.write_kv(job.request_id, layer, start, start + keys.shape[0], key, value)
        first = prefill.execute(chunk, on_layer)
        prefill.update(chunk)
        if chunk.last:
            prefill.finish(chunk.work)
    chunks, filled = decode.commit_kv(job.request_id, first), []
    while decode.has_work:
        batch, _ = decode.schedule()
        tokens = decode.execute(batch)
        filled += output.collect(batch)
        chunks += decode.update(batch, tokens)
    return [t for c in chunks for t in c.token_ids], filled


def test_the_blocks_decode_steps_fill_hash_and_hold_what_a_prefill_of_the_same_tokens_gives():
    tokens_in = prompt(10)
    generated, filled = served(prefill_engine(), tokens_in, max_tokens=9)
    # Positions 10..17 are fed (the 9th token never is): blocks 2 (8..11, half prompt) and 3 (12..15) fill.
    assert [block.depth for block in filled] == [2, 3] and {block.addr for block in filled} == {POOL}
    sequence = tokens_in + generated
    hashes = BlockHasher(block_size=BLOCK).hash_blocks(sequence)
    assert [block.block_hash for block in filled] == [to_hex(hashes[2]), to_hex(hashes[3])]
    runner = make_runner(block_size=BLOCK)
    blocks = make_pool(runner).allocate(4)
    runner.prefill(sequence[:16], blocks, 0)
    for block in filled:
        data = torch.frombuffer(bytearray(block.data), dtype=runner.dtype)
        torch.testing.assert_close(data, runner.read_blocks([blocks[block.depth]]).reshape(-1), atol=1e-5, rtol=1e-5)


def test_a_request_without_a_pool_fills_nothing_to_write_back():
    assert served(prefill_engine(), prompt(10), max_tokens=9, pool_addr="")[1] == []


def test_a_continuation_finding_the_written_back_blocks_computes_only_its_last_partial_block():
    prefill = prefill_engine()
    tokens_in, sampling = prompt(10), greedy(12)
    generated, filled = served(prefill, tokens_in, max_tokens=9)
    assert prefill.host is not None
    for block in filled:  # what the prefill's messenger does with a PutBlocks stream
        assert prefill.host.put(block.block_hash, block.depth, block.data)
    computed = prefill.stats["prefill_tokens_computed"]

    token_ids, resumed = continuation(tokens_in, generated, sampling)  # 19 tokens: blocks 0-3 held, 3 to compute
    prefill.submit(prefill_job(token_ids, resumed))
    chunk = prefill.schedule()
    first = prefill.execute(chunk)
    prefill.update(chunk)
    prefill.finish(chunk.work)

    assert (chunk.start, chunk.end) == (16, 19) and chunk.last
    assert prefill.stats["prefill_tokens_computed"] - computed == 3
    assert prefill.stats["prefill_tokens_from_host"] == 8  # blocks 2 and 3, written back by the decode
    reference = make_runner(block_size=BLOCK)
    expected, _ = generate(reference, make_pool(reference), tokens_in, greedy(10))
    assert generated + [first] == expected
