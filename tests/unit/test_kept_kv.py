"""A prefill killed mid-prompt, on the CPU with no servers (`engine/service/keptkv.py`): the decode instance's sink
keeps the blocks whose every layer arrived findable by the hashes a prefill gives the same tokens, with no block
held; served to a pull they are what the prefill computed, and a continuation that finds them computes only the
rest of the prompt and gives the tokens of an undisturbed run. Kept blocks are forgotten once handed over, reused,
or past --kv-keep-s; a cancelled request keeps nothing."""

from __future__ import annotations

import asyncio
import collections
import time
import types

import torch

from factories import decode_job, greedy, make_pool, make_runner, prefill_job, prompt
from kvcentric.core.hashing import BlockHasher, to_hex
from kvcentric.engine.cores.decode import DecodeEngine
from kvcentric.engine.cores.prefill import PrefillEngine
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.model.local import generate
from kvcentric.engine.model.runner import kv_payload
from kvcentric.engine.service import kvsink
from kvcentric.engine.service.intake import JobIntake
from kvcentric.engine.service.keptkv import KeptKV
from kvcentric.engine.service.node import Wakeup
from kvcentric.engine.service.spans import RequestSpans

BLOCK, CHUNK = 4, 8
PROMPT = 30
"""Tokens of the prompt: chunks 0..8, 8..16, 16..24, 24..30."""


def prefill_engine() -> PrefillEngine:
    runner = make_runner(block_size=BLOCK)
    return PrefillEngine(runner, make_pool(runner), BlockHasher(block_size=BLOCK), chunk_tokens=CHUNK,
                         host=HostBlockPool(64, runner.block_bytes))


def decode_side(keep_s: float = 30.0) -> tuple[kvsink.DecodeSink, DecodeEngine, KeptKV, list]:
    """A decode engine, its sink with the KV of broken pushes kept, and the chunks the sink emits."""
    runner = make_runner(block_size=BLOCK)
    engine = DecodeEngine(runner, make_pool(runner))
    intake, spans, emitted = JobIntake(collections.Counter()), RequestSpans(), []
    sink = kvsink.DecodeSink(engine, intake.counters, intake, spans, emitted.extend, Wakeup())
    sink.kept = KeptKV(engine, BlockHasher(block_size=BLOCK), keep_s)
    return sink, engine, sink.kept, emitted


def killed_mid_prompt(token_ids: list[int], chunks_whole: int, layers_of_next: int) -> tuple[DecodeEngine, KeptKV,
                                                                                            PrefillEngine, list]:
    """A prompt prefilled chunk by chunk, each layer pushed to the decode side as it is computed, until the
    prefill dies during chunk `chunks_whole` (after `layers_of_next` of its layers went out): the push breaks off.
    Returns the decode engine, its kept KV, the (dead) prefill engine and what the sink emitted."""
    sink, engine, kept, emitted = decode_side()
    prefill = prefill_engine()
    job = prefill_job(token_ids, greedy(4))
    prefill.submit(job)
    engine.add(decode_job(job.request_id, len(token_ids), job.sampling), time.monotonic())
    header = types.SimpleNamespace(request_id=job.request_id, dtype=engine.runner.dtype_name,
                                   num_tokens=len(token_ids), num_layers=engine.runner.config.num_layers,
                                   token_ids=token_ids, stripes=1, pool_addr="")
    asyncio.run(sink.begin(header))
    for index in range(chunks_whole + 1):
        chunk = prefill.schedule()
        layers = engine.runner.config.num_layers if index < chunks_whole else layers_of_next

        def on_layer(layer, keys, values, start=chunk.start, layers=layers):
            if layer < layers:
                key, value, _ = kv_payload(keys, values)
                engine.write_kv(job.request_id, layer, start, start + keys.shape[0], key, value)
        prefill.execute(chunk, on_layer)
        prefill.update(chunk)
    sink.abort(job.request_id, "push did not complete")  # what the messenger does when the stream breaks
    return engine, kept, prefill, emitted


def test_a_broken_push_leaves_its_whole_blocks_findable_and_holds_none():
    token_ids = prompt(PROMPT)
    engine, kept, _, emitted = killed_mid_prompt(token_ids, chunks_whole=2, layers_of_next=1)
    hashes = [to_hex(h) for h in BlockHasher(block_size=BLOCK).hash_blocks(token_ids)]
    pool = engine.kv.pool
    assert list(pool.hash_to_block) == hashes[:4]  # chunks 0..16 arrived in every layer: 4 blocks
    assert engine.kv.idle  # every block free again: nothing kept can leak
    assert kept.stats["kv_blocks_kept"] == 4 and kept.stats["kv_tokens_kept"] == 16
    assert emitted[0].finish_reason == "error" and emitted[0].error_status == 503  # the request still fails
    assert pool.drain_events() == (hashes[:4], [])  # what the decode instance announces


def test_the_kept_blocks_served_are_the_prefills_and_its_continuation_computes_only_the_rest():
    token_ids = prompt(PROMPT)
    engine, kept, _, _ = killed_mid_prompt(token_ids, chunks_whole=2, layers_of_next=3)
    hashes = [to_hex(h) for h in BlockHasher(block_size=BLOCK).hash_blocks(token_ids)]
    served = list(kept.read_blocks(hashes, engine.runner.dtype_name, BLOCK))
    assert [h for h, data in served] == hashes[:5] and served[-1][1] is None  # stops at the first it lacks
    runner = make_runner(block_size=BLOCK)
    blocks = make_pool(runner).allocate(4)
    runner.prefill(token_ids[:16], blocks, 0)
    for depth, (_, data) in enumerate(served[:4]):  # the KV a prefill of those tokens computes
        as_computed = torch.frombuffer(bytearray(data), dtype=runner.dtype)
        torch.testing.assert_close(as_computed, runner.read_blocks([blocks[depth]]).reshape(-1), atol=1e-5, rtol=1e-5)

    survivor = prefill_engine()
    assert survivor.host is not None
    for depth, (block_hash, data) in enumerate(served[:4]):  # what a pull does with them (`pull_blocks`)
        assert survivor.host.put(block_hash, depth, data)
    survivor.submit(prefill_job(token_ids, greedy(4)))
    first = None
    while (chunk := survivor.schedule()) is not None:
        first = survivor.execute(chunk)
        survivor.update(chunk)
        if chunk.last:
            survivor.finish(chunk.work)
    assert survivor.stats["prefill_tokens_computed"] == PROMPT - 16
    assert survivor.stats["prefill_tokens_from_host"] == 16
    reference = make_runner(block_size=BLOCK)
    assert first == generate(reference, make_pool(reference), token_ids, greedy(1))[0][0]


def test_kept_blocks_served_whole_are_handed_over_and_forgotten():
    token_ids = prompt(PROMPT)
    engine, kept, _, _ = killed_mid_prompt(token_ids, chunks_whole=3, layers_of_next=0)
    hashes = [to_hex(h) for h in BlockHasher(block_size=BLOCK).hash_blocks(token_ids)]
    engine.kv.pool.drain_events()
    wanted = hashes[:6]
    assert [h for h, _ in kept.read_blocks(wanted, engine.runner.dtype_name, BLOCK)] == wanted
    assert not engine.kv.pool.hash_to_block and len(kept.kept) == 0
    assert engine.kv.pool.drain_events() == ([], wanted)  # announced gone
    assert kept.stats["kv_blocks_kept_handed_over"] == 6


def test_kept_blocks_are_forgotten_after_keep_s_and_a_reused_one_is_not_served():
    token_ids = prompt(PROMPT)
    engine, kept, _, _ = killed_mid_prompt(token_ids, chunks_whole=2, layers_of_next=0)
    hashes = [to_hex(h) for h in BlockHasher(block_size=BLOCK).hash_blocks(token_ids)]
    pool = engine.kv.pool
    taken = engine.kv.allocate(pool.num_blocks - 2)  # the two blocks left free, reused last, are kept ones
    served = list(kept.read_blocks(hashes, engine.runner.dtype_name, BLOCK))
    assert [h for h, data in served if data is not None] == hashes[:2] and served[-1] == (hashes[2], None)
    engine.kv.free(taken)
    assert kept.expire(time.monotonic()) == 0  # none due yet
    assert kept.expire(time.monotonic() + 31.0) == 2 and not pool.hash_to_block
    assert engine.kv.idle


def test_a_cancelled_request_keeps_nothing():
    sink, engine, kept, _ = decode_side()
    engine.add(decode_job("r", 8), time.monotonic())
    engine.begin_kv("r", 8, engine.runner.config.num_layers, list(range(8)))
    zeros = bytes(8 * engine.runner.layer_token_bytes)
    for layer in range(engine.runner.config.num_layers):
        engine.write_kv("r", layer, 0, 8, zeros, zeros)
    sink.cancelled("r")
    engine.abort("r", "abort")  # what the decode service does with a Cancel
    assert not engine.kv.pool.hash_to_block and kept.stats["kv_blocks_kept"] == 0 and engine.kv.idle
