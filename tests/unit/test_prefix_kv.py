"""PrfaaS §3.3 on the engines: the prefill pushes only the KV after `kv_skip_tokens`, the decode side cuts
the prefix it pulled from its own cluster (host-pool blocks) into per-layer key and value bytes, and the
jobs carry the placement's prefix to both."""

from __future__ import annotations

import msgspec
import pytest
import torch

from factories import greedy, make_pool, make_runner, prefill_job, prompt
from kvcentric.core.dispatch import jobs
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.protocol import Placement
from kvcentric.engine.cores.prefill import PrefillEngine, PrefillRejected
from kvcentric.engine.service.prefixkv import prefix_layers
from kvcentric.engine.service.streaming import RequestPush
from kvcentric.runtime.kvwire import LayerData
from test_streaming import RecordingPusher, settle


def host_block(layers: int, block_size: int, token_bytes: int, tag: int) -> bytes:
    """A host-pool block whose byte at (layer, key/value, token) is tag*64 + layer*4 + kv*2 + token%2."""
    out = bytearray()
    for layer in range(layers):
        for kv in (0, 1):
            for token in range(block_size):
                out += bytes([tag * 64 + layer * 4 + kv * 2 + token % 2]) * token_bytes
    return bytes(out)


def test_prefix_layers_cut_each_layer_from_every_block_and_the_last_in_part():
    blocks = [host_block(2, 4, 3, tag) for tag in (0, 1)]
    cut = list(prefix_layers(blocks, 6, num_layers=2, block_size=4, layer_token_bytes=3))
    assert [layer for layer, _, _ in cut] == [0, 1]
    layer, key, value = cut[1]
    assert len(key) == len(value) == 6 * 3
    assert key == bytes([4, 4, 4, 5, 5, 5] * 2 + [68, 68, 68, 69, 69, 69])  # 4 tokens of block 0, 2 of block 1
    assert value == bytes(b + 2 for b in key)


def test_prefix_layers_refuse_a_prefix_longer_than_the_blocks_or_a_block_of_the_wrong_size():
    block = host_block(2, 4, 3, 0)
    with pytest.raises(ValueError, match="cannot hold"):
        list(prefix_layers([block], 5, 2, 4, 3))
    with pytest.raises(ValueError, match="not 48 bytes"):
        list(prefix_layers([block[:-1]], 2, 2, 4, 3))


def test_prefix_layers_lay_out_what_the_runner_wrote_to_the_host_pool():
    runner = make_runner()
    pool = make_pool(runner)
    blocks = pool.allocate(2)
    tokens = 2 * runner.block_size - 3
    runner.prefill(prompt(tokens), blocks, 0, tokens)
    host = runner.read_blocks(blocks)  # [blocks, layers, 2, block_size, heads, dim]
    pulled = [host[i].contiguous().view(torch.uint8).numpy().tobytes() for i in range(2)]
    for layer, key, value in prefix_layers(pulled, tokens, runner.config.num_layers, runner.block_size,
                                           runner.layer_token_bytes):
        expected_key, expected_value, _ = runner.read_layer(layer, blocks, 0, tokens)
        assert key == expected_key and value == expected_value


async def test_the_push_skips_the_tokens_the_receiver_has_from_its_own_cluster():
    runner = make_runner()
    engine = PrefillEngine(runner, make_pool(runner), BlockHasher("sha256_hex", runner.block_size), 512)
    job = prefill_job(prompt(20))
    engine.submit(msgspec.structs.replace(job, kv_skip_tokens=12))
    chunk = engine.schedule()
    pusher = RecordingPusher()
    push = RequestPush(runner, pusher, chunk.work)
    token = engine.execute(chunk, push.hook(chunk.start))
    await settle()
    push.finish(token)
    await push.task
    layers = [item for item in pusher.items if isinstance(item, LayerData)]
    assert len(layers) == runner.config.num_layers
    assert {(item.token_start, item.token_end) for item in layers} == {(12, 20)}
    assert sum(item.nbytes for item in layers) == 8 * 2 * runner.config.num_layers * runner.layer_token_bytes


def test_a_job_must_push_at_least_the_last_token():
    runner = make_runner()
    engine = PrefillEngine(runner, make_pool(runner), BlockHasher(block_size=runner.block_size))
    job = prefill_job(prompt(8))
    bad = msgspec.structs.replace(job, kv_skip_tokens=8)
    with pytest.raises(PrefillRejected, match="last prompt token"):
        engine.check(bad)


def test_the_jobs_carry_the_placements_local_prefix_to_prefill_and_decode():
    placement = Placement(request_id="r", prefill_id="r0", decode_id="d0", decode_kv_addr="d0:1",
                          decode_prefix_addr="a0:7", decode_prefix_hashes=["h0", "h1"], decode_prefix_tokens=32)
    (_, _, prefill), (_, _, decode) = jobs("r", placement, list(range(40)), greedy())
    assert prefill.kv_skip_tokens == 32
    assert (decode.prefix_source_addr, decode.prefix_block_hashes, decode.prefix_tokens) == ("a0:7", ["h0", "h1"], 32)
    plain = Placement(request_id="r", prefill_id="p", decode_id="d", decode_kv_addr="d:1")
    (_, _, prefill), (_, _, decode) = jobs("r", plain, list(range(40)), greedy())
    assert prefill.kv_skip_tokens == 0 and decode.prefix_source_addr == "" and decode.prefix_tokens == 0
