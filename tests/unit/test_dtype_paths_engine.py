"""Half-precision KV on the node-local paths: blocks written to the host pool and loaded back into the cache
are the cache's own bytes and give the tokens of a run without any cache, and `kvcentric profile` fits a cost
model whose KV size is that of the dtype. Every dtype the engine accepts (fp32 is covered elsewhere)."""

import pytest
import torch

from factories import TEST_DEVICE, greedy, prefill_job, prompt
from kvcentric.core.block_pool import BlockPool
from kvcentric.core.costmodel import CostModel
from kvcentric.core.hashing import BlockHasher
from kvcentric.engine.config import ProfileConfig
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.model.local import generate
from kvcentric.engine.cores.prefill import PrefillEngine
from kvcentric.engine.model.profile import main as profile_main
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import preset

HALF = ["float16", "bfloat16"]


def prefill(engine: PrefillEngine, token_ids: list[int]):
    engine.submit(prefill_job(token_ids, greedy()))
    chunk = engine.schedule()
    first = engine.execute(chunk)
    engine.update(chunk)
    engine.finish(chunk.work)
    return chunk.work, first


@pytest.mark.parametrize("dtype", HALF)
def test_blocks_reloaded_from_the_host_pool_are_the_cache_bytes_and_give_the_same_tokens(dtype):
    runner = ModelRunner(preset("tiny"), 8, 4, 0, dtype=dtype, device=TEST_DEVICE)
    host = HostBlockPool(64, runner.block_bytes)
    engine = PrefillEngine(runner, BlockPool(8, 4), BlockHasher(block_size=4), host=host)
    work, first = prefill(engine, prompt(21))
    assert engine.writer is not None
    engine.writer.collect(wait=True)
    computed = {h: runner.read_blocks([b])[0].clone() for h, b in zip(work.hashes, work.blocks)}
    for block_hash, expected in computed.items():  # the host pool holds the cache's raw bytes
        assert torch.equal(host.view(block_hash).view(runner.dtype).view(expected.shape), expected)
    prefill(engine, [9] * 28)  # evicts the first prompt's deeper blocks from the cache
    again, first_again = prefill(engine, prompt(21))
    assert engine.stats["prefill_tokens_from_host"] == 16
    for block_hash, block in zip(again.hashes, again.blocks):
        assert torch.equal(runner.read_blocks([block])[0], computed[block_hash])
    reference = ModelRunner(preset("tiny"), 64, 4, 0, dtype=dtype, device=TEST_DEVICE)
    expected, _ = generate(reference, BlockPool(64, 4), prompt(21), greedy(1))
    assert first == first_again == expected[0]


@pytest.mark.parametrize("dtype", HALF)
def test_the_profile_fits_a_cost_model_in_half_precision(dtype, tmp_path):
    out = tmp_path / "profile.json"
    assert profile_main(ProfileConfig(model="tiny", dtype=dtype, out=str(out), max_tokens=64, repeat=1)) == 0
    model = CostModel.load(out)
    assert model.kv_bytes_per_token == 4 * 2 * 2 * 16 * 2  # tiny: layers x (k, v) x kv_heads x head_dim x 2 bytes
    assert model.t_prefill(64, 0) > 0 and model.t_decode(4, 256) > 0
