"""LayerKV in the colocated engine: with layers on the host, loaded back and stored layer by layer beside the
compute, greedy generation gives exactly the tokens (fp32) of the engine without it; the SLO-aware scheduler
holds a prompt while it would break the decoding requests' TPOT SLO; nothing leaks."""

import functools

import pytest
import torch

from factories import decode_job, greedy, make_pool, make_runner, prefill_job, prompt
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.layerkv.pool import LayerBlockPool
from kvcentric.engine.cores.colocated import ColocatedEngine
from kvcentric.engine.kv.layered import LayeredKV
from kvcentric.engine.cores.layerkv import LayerKV

PROMPTS = [prompt(n, offset=n) for n in (7, 19, 30)]


def layerkv_engine(device_blocks: int, host_blocks: int, threshold: float, tpot_slo_s: float = 0.0,
                   decode_mode: str = "swap") -> ColocatedEngine:
    runner = make_runner(num_blocks=device_blocks, block_size=4)
    pool = LayerBlockPool(device_blocks, 4, runner.config.num_layers, host_blocks)
    layered = LayeredKV(runner, pool)
    layered.bandwidth_bps = 1e12  # eq. 4 lets every layer leave
    control = LayerKV(pool, layered, tpot_slo_s, threshold, flops=1e12, decode_mode=decode_mode)
    return ColocatedEngine(runner, pool, BlockHasher(block_size=4), chunk_tokens=6, layerkv=control)


def generate_all(engine: ColocatedEngine, max_tokens: int = 12) -> list[list[int]]:
    for index, tokens in enumerate(PROMPTS):
        job = prefill_job(tokens, greedy(max_tokens), request_id=f"r{index}")
        engine.submit(job, decode_job(job.request_id, len(tokens), greedy(max_tokens)))
    out: dict[str, list[int]] = {f"r{index}": [] for index in range(len(PROMPTS))}
    while engine.has_work:
        for chunk in engine.step():
            out[chunk.request_id] += chunk.token_ids
    return [out[f"r{index}"] for index in range(len(PROMPTS))]


@functools.cache
def reference() -> list[list[int]]:
    runner = make_runner(block_size=4)
    return generate_all(ColocatedEngine(runner, make_pool(runner), BlockHasher(block_size=4), chunk_tokens=6))


def assert_all_free(engine: ColocatedEngine) -> None:
    pool = engine.pool
    assert isinstance(pool, LayerBlockPool)
    assert pool.device_free_layer_blocks == pool.device_layer_blocks
    assert len(pool.host_free) == pool.host_blocks


@pytest.mark.parametrize("decode_mode", ["swap", "stream"])
def test_every_layer_on_the_host_gives_the_same_greedy_tokens(decode_mode):
    engine = layerkv_engine(device_blocks=16, host_blocks=400, threshold=1.0,  # nothing may stay on the device
                            decode_mode=decode_mode)
    assert generate_all(engine) == reference()
    assert engine.layerkv is not None
    stats = engine.layerkv.gauges()
    layers = engine.runner.config.num_layers
    assert stats["layerkv_prompt_layers_offloaded"] == layers * len(PROMPTS)  # every layer of every prompt
    assert stats["layerkv_retained_layers_sum"] == 0
    assert stats["layerkv_bytes_to_host"] > 0 and stats["layerkv_bytes_to_device"] > 0
    assert stats["layerkv_forecast_offloads"] > 0  # the blocks they grew into went to the host too
    assert_all_free(engine)


def test_some_layers_on_the_device_some_on_the_host_gives_the_same_greedy_tokens():
    engine = layerkv_engine(device_blocks=12, host_blocks=400, threshold=0.1)
    assert generate_all(engine) == reference()
    assert engine.layerkv is not None
    stats = engine.layerkv.gauges()
    assert stats["layerkv_retained_layers_sum"] > 0 and stats["layerkv_prompt_layers_offloaded"] > 0
    assert stats["layerkv_layers_reloaded"] > 0 and stats["layerkv_layers_stored"] > 0
    assert stats["layerkv_layer_blocks_reloaded"] > 0  # host layers came back into device blocks
    assert_all_free(engine)


def test_layered_prefill_logits_equal_the_plain_runner_exactly():
    tokens = prompt(23, offset=3)
    plain = make_runner(block_size=4)
    table = make_pool(plain).allocate(6)
    expected = torch.cat([plain.prefill(tokens, table, 0, 10, every_row=True),
                          plain.prefill(tokens, table, 10, every_row=True)])
    engine = layerkv_engine(device_blocks=8, host_blocks=64, threshold=0.0)
    pool = engine.pool
    assert isinstance(pool, LayerBlockPool)
    pool.placement = [1]  # one layer kept, the others on the host
    blocks = pool.allocate(6)
    pool.placement = None
    first = engine.runner.prefill(tokens, blocks, 0, 10, every_row=True)  # two chunks: the second reloads
    second = engine.runner.prefill(tokens, blocks, 10, every_row=True)
    assert torch.equal(torch.cat([first, second]), expected)


def test_the_slo_aware_scheduler_holds_prompts_while_decoding_requests_would_miss_the_tpot_slo():
    engine = layerkv_engine(device_blocks=64, host_blocks=400, threshold=0.1, tpot_slo_s=1e-6)
    assert engine.layerkv is not None
    engine.layerkv.tpot_s = 1.0  # each decode step far over the SLO: no prefill fits any budget
    assert generate_all(engine, max_tokens=6) == [tokens[:6] for tokens in reference()]
    stats = engine.layerkv.gauges()
    assert stats["layerkv_held_for_slo"] > 0
    assert stats["layerkv_prefills_admitted"] == len(PROMPTS)
    assert engine.decode.stats["batch_size_sum"] == engine.decode.stats["decode_steps"]  # one decoding at a time


def test_offloaded_layers_swap_back_in_once_the_forecast_has_room_and_then_decode_in_place():
    engine = layerkv_engine(device_blocks=16, host_blocks=400, threshold=0.0)
    plain_runner = make_runner(block_size=4)
    plain = ColocatedEngine(plain_runner, make_pool(plain_runner), BlockHasher(block_size=4), chunk_tokens=6)
    control, pool, layers = engine.layerkv, engine.pool, engine.runner.config.num_layers
    assert control is not None and isinstance(pool, LayerBlockPool)
    tokens, out = [], []
    for each in (plain, engine):
        job = prefill_job(PROMPTS[0], greedy(40), request_id="r")
        each.submit(job, decode_job("r", len(PROMPTS[0]), greedy(40)))
    while plain.has_work:
        tokens += [t for chunk in plain.step() for t in chunk.token_ids]
    while "r" not in engine.decode.requests:
        out += [t for chunk in engine.step() for t in chunk.token_ids]
    request = engine.decode.requests["r"]
    pool.offload(request.blocks)  # as eq. 5 would, then a burst takes all but 4 device blocks of each layer
    pool.placement = list(range(layers))
    burst = pool.allocate(12)
    pool.placement = None

    def step() -> dict[str, float]:
        out.extend(t for chunk in engine.step() for t in chunk.token_ids)
        return control.gauges()
    before = step()
    after = [step() for _ in range(5)]
    assert after[-1]["layerkv_layer_blocks_reloaded"] == 0  # with it back, the forecast would dip below 0
    assert after[-1]["layerkv_layers_reloaded"] > before["layerkv_layers_reloaded"]  # read from the host each step
    pool.free(burst)
    swapped = step()
    assert swapped["layerkv_swap_ins"] == 1 and swapped["layerkv_layer_blocks_reloaded"] > 0
    assert all(pool.device_layers(request.blocks))
    in_place = [step() for _ in range(3)]
    assert in_place[-1]["layerkv_layers_reloaded"] == in_place[0]["layerkv_layers_reloaded"]  # no host reads
    while engine.has_work:
        step()
    assert out == tokens
    assert_all_free(engine)


def test_swap_holds_a_request_with_host_layers_out_of_the_batch_and_stream_does_not():
    """The paper's vLLM base: a request whose layers are not all on the device waits to swap in. With every
    layer kept on the host (threshold 1: nothing ever swaps back), swap decodes one request at a time (the
    oldest; someone must), stream decodes them all at once, reading their layers every step; same tokens."""
    steps = {}
    for mode in ("swap", "stream"):
        engine = layerkv_engine(device_blocks=16, host_blocks=400, threshold=1.0, decode_mode=mode)
        assert generate_all(engine) == reference()
        assert engine.layerkv is not None
        steps[mode] = engine.decode.stats["batch_size_sum"], engine.decode.stats["decode_steps"]
        held = engine.layerkv.gauges()["layerkv_decode_held_steps"]
        assert (held > 0) == (mode == "swap")
        assert_all_free(engine)
    assert steps["swap"][0] == steps["swap"][1]  # one request per decode step
    assert steps["stream"][0] > steps["stream"][1]  # several


def test_a_held_request_rejoins_the_batch_once_its_layers_are_back():
    engine = layerkv_engine(device_blocks=64, host_blocks=400, threshold=0.0)
    control, pool = engine.layerkv, engine.pool
    assert control is not None and isinstance(pool, LayerBlockPool)
    for index, tokens in enumerate(PROMPTS[:2]):
        job = prefill_job(tokens, greedy(12), request_id=f"r{index}")
        engine.submit(job, decode_job(job.request_id, len(tokens), greedy(12)))
    while len([r for r in engine.decode.requests.values() if r.state == "running"]) < 2:
        engine.step()
    newest = engine.decode.requests["r1"]
    pool.offload(newest.blocks)  # as eq. 5 would when short of blocks
    assert control.held(engine.decode) == {"r1"}  # r0 decodes alone
    _, batch, _ = engine.schedule()  # admit() swaps r1 back in: the forecast has room again
    assert [r.key for r in batch] == ["r0", "r1"] and not pool.host_layer_blocks_of(newest.blocks)
    assert control.gauges()["layerkv_swap_ins"] >= 1
