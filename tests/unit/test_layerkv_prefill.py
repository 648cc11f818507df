"""LayerKV in the prefill role: a prompt whose KV does not fit in the device blocks starts with its layers split
between device and host; the KV its layer hook streams out, the KV a resend reads back (`runner.read_layer`)
and its first token are exactly (fp32) the plain engine's; nothing leaks; a role change gives the next role a
plain runner."""

from __future__ import annotations

import torch

from factories import greedy, make_pool, make_runner, prefill_job, prompt
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.layerkv.pool import LayerBlockPool
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.kv.layered import LayeredKV
from kvcentric.engine.cores.layerkv import LayerKV
from kvcentric.engine.cores.prefill import PrefillEngine, PrefillWork
from kvc_prefill.service import PrefillService

DEVICE_BLOCKS = 4
"""16 tokens per layer on the device (4-token blocks); the prompts below need more."""


def layerkv_prefill(host_blocks: int = 200) -> tuple[PrefillEngine, LayerKV]:
    runner = make_runner(num_blocks=DEVICE_BLOCKS, block_size=4)
    pool = LayerBlockPool(DEVICE_BLOCKS, 4, runner.config.num_layers, host_blocks)
    layered = LayeredKV(runner, pool)
    layered.bandwidth_bps = 1e12  # eq. 4 lets every layer leave
    control = LayerKV(pool, layered, tpot_slo_s=0.2, offload_threshold=0.5, flops=1e12)
    return PrefillEngine(runner, pool, BlockHasher(block_size=4), chunk_tokens=7), control


def prefill_all(engine: PrefillEngine, control: LayerKV | None, tokens: list[int]):
    """Run the prompt to its first token as the prefill service does; the KV its hook saw per layer."""
    engine.submit(prefill_job(tokens, greedy(4), request_id="r"))
    streamed: dict[int, list[torch.Tensor]] = {}

    def on_layer(layer: int, keys, values) -> None:
        streamed.setdefault(layer, []).append(torch.cat([keys, values], dim=-1).clone())
    while True:
        admitted = control.admit(engine, None, 0.0) if control is not None else True
        chunk = engine.schedule() if admitted else None
        if control is not None:
            control.placed(engine, 0.0)
        assert chunk is not None
        first = engine.execute(chunk, on_layer)
        engine.update(chunk)
        if chunk.last:
            engine.complete(chunk.work)
            return first, chunk.work, {layer: torch.cat(parts) for layer, parts in streamed.items()}


def read_back(engine: PrefillEngine, work: PrefillWork) -> list[tuple[bytes, bytes, int]]:
    return [engine.runner.read_layer(layer, work.blocks, 0, work.num_tokens)
            for layer in range(engine.runner.config.num_layers)]


def test_a_prompt_larger_than_the_device_blocks_streams_and_reads_back_the_plain_engines_kv():
    tokens = prompt(30, offset=5)
    plain = make_runner(num_blocks=64, block_size=4)
    reference = PrefillEngine(plain, make_pool(plain), BlockHasher(block_size=4), chunk_tokens=7)
    expected_first, expected_work, expected_kv = prefill_all(reference, None, tokens)

    engine, control = layerkv_prefill()
    first, work, streamed = prefill_all(engine, control, tokens)
    pool = control.pool
    layers = engine.runner.config.num_layers
    assert pool.blocks_for(len(tokens)) > DEVICE_BLOCKS
    assert pool.device_layers(work.blocks) == [False] * layers  # no layer fits: every one is in host memory
    assert first == expected_first
    assert all(torch.equal(streamed[layer], expected_kv[layer]) for layer in range(layers))
    assert read_back(engine, work) == read_back(reference, expected_work)
    stats = control.gauges()
    assert stats["layerkv_prompt_layers_offloaded"] == layers and stats["layerkv_bytes_to_host"] > 0
    assert stats["layerkv_prefills_admitted"] == 1
    engine.finish(work)
    assert pool.device_free_layer_blocks == pool.device_layer_blocks and len(pool.host_free) == pool.host_blocks


def test_a_prompt_that_fits_some_layers_keeps_them_on_the_device_and_reads_back_from_both():
    tokens = prompt(14, offset=2)  # 4 blocks: a layer's whole device cache
    plain = make_runner(num_blocks=64, block_size=4)
    reference = PrefillEngine(plain, make_pool(plain), BlockHasher(block_size=4), chunk_tokens=7)
    _, expected_work, _ = prefill_all(reference, None, tokens)

    engine, control = layerkv_prefill()
    control.pool.placement = [0]
    taken = control.pool.allocate(2)  # two of layer 0's device blocks are taken: it cannot keep this prompt
    control.pool.placement = None
    _, work, _ = prefill_all(engine, control, tokens)
    # Spread evenly, as many as fit: layers 1 and 3 (no reserve held back on a prefill instance).
    assert control.pool.device_layers(work.blocks) == [False, True, False, True]
    assert read_back(engine, work) == read_back(reference, expected_work)
    engine.finish(work)
    control.pool.free(taken)


def test_a_prompt_waits_while_neither_device_nor_host_has_room_for_its_layers():
    engine, control = layerkv_prefill(host_blocks=40)
    control.pool.placement = []
    taken = control.pool.allocate(3)  # 12 of the 40 host layer blocks: 28 left, the prompt needs 4 × 8
    control.pool.placement = None
    engine.submit(prefill_job(prompt(30), greedy(4), request_id="r"))
    assert control.unplaceable(30) == ""
    assert not control.admit(engine, None, 0.0)
    assert control.gauges()["layerkv_held_for_blocks"] == 1
    control.pool.free(taken)
    assert control.admit(engine, None, 0.0) and engine.schedule() is not None


def test_a_prompt_that_could_never_be_placed_is_named():
    _, control = layerkv_prefill(host_blocks=16)  # 4 device blocks a layer, 16 host layer blocks in all
    assert control.unplaceable(16) == ""  # 4 blocks: every layer on the device
    assert control.unplaceable(17) != ""  # 5 blocks: no layer's device blocks hold it, and 4 × 5 > 16 on the host


def test_a_prefill_instance_with_layerkv_hands_a_plain_runner_to_its_next_role():
    service = PrefillService(EngineConfig(layerkv=True, num_kv_blocks=8, layerkv_host_mb=1, calibrate=False))
    assert isinstance(service.pool, LayerBlockPool) and service.runner.layered is not None
    assert service.engine.pool is service.pool and service.host is None
    service.role_change.next_role = "decode"
    successor = service.successor()
    assert successor is not None and successor.role == "decode"
    assert service.runner.layered is None and not isinstance(successor.pool, LayerBlockPool)
