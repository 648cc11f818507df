"""The host pool's two layouts hold the same blocks: block-major (a block's layers together) and layer-major
(one layer of every block together). Blocks go in and come out as the same bytes, the runner's copies into and
out of the pool give the same cache and the same pool contents in both, and a layer-wise load from a
layer-major pool copies runs of consecutive slots (contiguous ranges) rather than gathering."""

import pytest
import torch

from factories import make_runner
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.model.kvcache import slot_runs
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.model.config import preset


def pools(runner, capacity: int = 8) -> dict[str, HostBlockPool]:
    layers = runner.config.num_layers
    return {"block": HostBlockPool(capacity, runner.block_bytes), "layer": HostBlockPool(capacity, runner.block_bytes,
                                                                                         layers=layers)}


def random_block(runner, seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (runner.block_bytes,), dtype=torch.uint8, generator=generator).numpy().tobytes()


def test_slot_runs_are_the_runs_of_consecutive_slots_in_order():
    assert slot_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert slot_runs([]) == []


def test_a_layer_major_pool_keeps_one_layer_of_its_blocks_contiguous_and_gives_blocks_back_as_put():
    runner = make_runner(block_size=4)
    made = pools(runner)
    blocks = {f"h{i}": random_block(runner, i) for i in range(5)}
    for pool in made.values():
        for depth, (block_hash, data) in enumerate(blocks.items()):
            assert pool.put(block_hash, depth, data)
        assert {h: pool.read(h) for h in blocks} == blocks
        assert torch.equal(pool.view("h3").reshape(-1), torch.frombuffer(bytearray(blocks["h3"]), dtype=torch.uint8))
    layers = runner.config.num_layers
    assert torch.equal(made["block"].rows(layers), made["layer"].rows(layers))
    assert made["layer"].rows(layers)[:, 1].is_contiguous() and not made["block"].rows(layers)[:, 1].is_contiguous()
    with pytest.raises(ValueError, match="layers"):
        made["layer"].rows(layers + 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("slots", [[0, 1, 2, 3], [5, 1, 6, 2], [7, 0, 1, 2, 3, 4, 5, 6]],
                         ids=["one run", "scattered", "two runs"])
def test_a_layer_wise_load_fills_the_cache_alike_from_either_layout(slots, dtype):
    runner = ModelRunner(preset("tiny"), 16, 4, 0, dtype=dtype)
    caches = {}
    for name, pool in pools(runner).items():
        for slot in range(pool.capacity):
            assert pool.put(f"h{slot}", slot, random_block(runner, slot))
        assert [pool.slot_of[f"h{s}"] for s in range(pool.capacity)] == list(range(pool.capacity))
        runner.k_cache.zero_()
        runner.v_cache.zero_()
        targets = [15 - i for i in range(len(slots))]
        for layer in range(runner.config.num_layers):
            assert runner.load_host_layer(layer, pool.rows(runner.config.num_layers), slots, targets) is None
        caches[name] = runner.k_cache.view(torch.uint8).clone(), runner.v_cache.view(torch.uint8).clone()  # bits
        written = runner.read_blocks(targets)
        expected = torch.stack([torch.frombuffer(bytearray(pool.read(f"h{s}")), dtype=torch.uint8) for s in slots])
        assert torch.equal(written.reshape(len(slots), -1).view(torch.uint8).reshape(expected.shape), expected)
    assert all(torch.equal(a, b) for a, b in zip(caches["block"], caches["layer"]))


def test_the_runners_copies_into_the_pool_write_the_same_blocks_in_either_layout():
    runner = make_runner(num_blocks=16, block_size=4)
    runner.k_cache.copy_(torch.randn_like(runner.k_cache))
    runner.v_cache.copy_(torch.randn_like(runner.v_cache))
    contents = {}
    for name, pool in pools(runner).items():
        rows = pool.rows(runner.config.num_layers)
        runner.copy_blocks_to_host([3, 9], rows, [0, 5])
        for layer in range(runner.config.num_layers):
            runner.copy_layer_to_host(layer, [4, 2], rows, [6, 1])
        contents[name] = rows.clone()
    assert torch.equal(contents["block"], contents["layer"])
    cached = runner.read_blocks([3, 9, 4, 2]).reshape(4, -1).view(torch.uint8)
    rows = contents["layer"].reshape(8, -1)
    assert torch.equal(rows[[0, 5, 6, 1]], cached.reshape(4, -1))


def test_only_contiguous_layer_rows_are_copied_run_by_run(monkeypatch):
    runner = make_runner(num_blocks=16, block_size=4)
    runs: list[int] = []
    original = runner._load_runs
    monkeypatch.setattr(runner, "_load_runs", lambda layer, *args: runs.append(layer) or original(layer, *args))
    for name, pool in pools(runner).items():
        for slot in range(4):
            pool.put(f"h{slot}", slot, random_block(runner, slot))
        runner.load_host_layer(1, pool.rows(runner.config.num_layers), [0, 1, 2, 3], [8, 9, 10, 11])
        assert runs == ([1] if name == "layer" else [])
