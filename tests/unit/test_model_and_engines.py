"""The engine cores on CPU, no servers: paged attention, and the prefill -> decode hand-off."""

import time

import pytest
import torch

from factories import colocated_with_prompts, decode_job, greedy, make_pool, make_runner, prefill_job, prompt
from kvcentric.engine.cores.decode import DecodeEngine, KVRejected
from kvcentric.engine.model.local import generate
from kvcentric.engine.model.runner import kv_payload
from kvcentric.engine.cores.prefill import PrefillEngine, PrefillRejected
from kvcentric.core.hashing import BlockHasher
from kvcentric.model.config import check_fits, preset
from kvcentric.core.protocol import SamplingParams


def full_logits(runner, token_ids):
    """Logits of the last token computed from scratch (no cache reuse) in a fresh pool."""
    pool = make_pool(runner)
    blocks = pool.allocate(pool.blocks_for(len(token_ids)))
    return runner.prefill(token_ids, blocks, 0)


def test_decode_step_on_paged_cache_equals_full_recompute():
    runner = make_runner(block_size=4)
    pool = make_pool(runner)
    tokens = prompt(11)
    blocks = pool.allocate(pool.blocks_for(len(tokens) + 5))
    runner.prefill(tokens, blocks, 0)
    for step in range(5):
        next_token = (step * 31) % 256
        logits = runner.decode([next_token], [len(tokens)], [blocks])[0]
        tokens = tokens + [next_token]
        torch.testing.assert_close(logits, full_logits(runner, tokens), atol=1e-5, rtol=1e-5)


def test_prefill_reusing_a_cached_prefix_equals_full_prefill():
    runner = make_runner(block_size=4)
    pool = make_pool(runner)
    tokens = prompt(14)
    blocks = pool.allocate(pool.blocks_for(len(tokens)))
    runner.prefill(tokens[:8], blocks, 0)  # the first two blocks are now in the cache
    logits = runner.prefill(tokens, blocks, 8)
    torch.testing.assert_close(logits, full_logits(runner, tokens), atol=1e-5, rtol=1e-5)


def handoff(prefill: PrefillEngine, decode: DecodeEngine, job, params):
    """Move one request from the prefill engine to the decode engine chunk by chunk and layer by layer
    through the layer hook, as the prefill service and the messenger do."""
    decode.add(decode_job(job.request_id, len(job.token_ids), params), time.monotonic())
    decode.begin_kv(job.request_id, len(job.token_ids), prefill.runner.config.num_layers, job.token_ids)
    first = None
    while (chunk := prefill.schedule()) is not None:
        def on_layer(layer, keys, values, start=chunk.start):
            key, value, _ = kv_payload(keys, values)
            decode.write_kv(job.request_id, layer, start, start + keys.shape[0], key, value)
        first = prefill.execute(chunk, on_layer)
        prefill.update(chunk)
        if chunk.last:
            prefill.finish(chunk.work)
    return run_decode(decode, decode.commit_kv(job.request_id, first))


def run_decode(decode: DecodeEngine, chunks: list) -> tuple[list[int], object]:
    while decode.has_work:
        batch, failed = decode.schedule()
        assert not failed
        chunks += decode.update(batch, decode.execute(batch))
    return [t for c in chunks for t in c.token_ids], chunks[-1]


@pytest.mark.parametrize("params", [greedy(12), SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                                                                 ignore_eos=True)])
def test_disaggregated_generation_equals_single_process_generation(params):
    reference_runner = make_runner(block_size=4)
    expected, _ = generate(reference_runner, make_pool(reference_runner), prompt(21), params)
    p_runner, d_runner = make_runner(block_size=4), make_runner(block_size=4)
    prefill = PrefillEngine(p_runner, make_pool(p_runner), BlockHasher(block_size=4), chunk_tokens=8)
    decode = DecodeEngine(d_runner, make_pool(d_runner))
    job = prefill_job(prompt(21), params)
    prefill.submit(job)
    tokens, last = handoff(prefill, decode, job, params)
    assert tokens == expected
    assert last.finish_reason == "length" and last.completion_tokens == 12
    config = preset("tiny")
    assert decode.stats["kv_bytes_received"] == config.num_layers * 21 * 2 * config.num_kv_heads * config.head_dim * 4
    assert decode.stats["prefill_tokens_computed"] == 0
    assert decode.pool.num_free == decode.pool.num_blocks  # every block came back


def test_second_prefill_of_a_shared_prefix_computes_only_the_new_tokens():
    runner = make_runner(block_size=4)
    prefill = PrefillEngine(runner, make_pool(runner), BlockHasher(block_size=4))
    for job in (prefill_job(prompt(13)), prefill_job(prompt(13)[:12] + [9, 9, 9])):
        prefill.submit(job)
        chunk = prefill.schedule()
        prefill.execute(chunk)
        prefill.update(chunk)
        prefill.finish(chunk.work)
    assert prefill.stats["prefill_tokens_cached"] == 12
    assert prefill.stats["prefill_tokens_computed"] == 13 + 3
    stored, evicted = prefill.pool.drain_events()
    assert len(stored) == 3 + 0 and evicted == []  # 3 full blocks of the first prompt; the second adds none full


def test_prefill_refuses_prompts_longer_than_the_context():
    runner = make_runner()
    prefill = PrefillEngine(runner, make_pool(runner), BlockHasher(block_size=4))
    with pytest.raises(PrefillRejected):
        prefill.submit(prefill_job(prompt(runner.config.max_position)))


def test_decode_refuses_kv_for_unknown_requests_and_wrong_shapes():
    runner = make_runner()
    decode = DecodeEngine(runner, make_pool(runner))
    with pytest.raises(KVRejected):
        decode.begin_kv("nobody", 4, runner.config.num_layers)
    decode.add(decode_job("r", 4), time.monotonic())
    with pytest.raises(KVRejected):
        decode.begin_kv("r", 5, runner.config.num_layers)
    decode.begin_kv("r", 4, runner.config.num_layers)
    with pytest.raises(ValueError):
        decode.write_kv("r", 0, 0, 4, b"short", b"short")
    with pytest.raises(KVRejected):
        decode.commit_kv("r", 1)  # layers missing
    final = decode.abort("r", "error", "test")
    assert final.finish_reason == "error" and decode.pool.num_free == decode.pool.num_blocks


def test_decode_fails_requests_whose_kv_never_arrives():
    runner = make_runner()
    decode = DecodeEngine(runner, make_pool(runner))
    decode.add(decode_job("late", 4, wait_s=1.0), now=100.0)
    assert decode.expire(now=100.5) == []
    [chunk] = decode.expire(now=101.5)
    assert chunk.finish_reason == "error" and "late" not in decode.requests


def test_model_that_does_not_fit_in_memory_is_refused_with_numbers():
    with pytest.raises(MemoryError, match="llama2-70b.*GiB"):
        check_fits(preset("llama2-70b"), kv_bytes=0, dtype_size=4, available=8 << 30)
    small = preset("small")
    weights = small.num_params * 4
    check_fits(small, kv_bytes=0, dtype_size=4, available=weights)
    with pytest.raises(MemoryError, match="weights"):  # a CPU fp32 model keeps its projections in two layouts
        check_fits(small, kv_bytes=0, dtype_size=4, available=weights, weight_copies=2)


def test_chunked_prefill_runs_in_chunks_and_gives_the_same_first_token():
    runner = make_runner(block_size=4)
    whole = PrefillEngine(runner, make_pool(runner), BlockHasher(block_size=4), chunk_tokens=1000)
    chunked = PrefillEngine(make_runner(block_size=4), make_pool(runner), BlockHasher(block_size=4), chunk_tokens=5)
    firsts = []
    for engine in (whole, chunked):
        engine.submit(prefill_job(prompt(23)))
        while (chunk := engine.schedule()) is not None:
            first = engine.execute(chunk)
            engine.update(chunk)
            if chunk.last:
                engine.finish(chunk.work)
                firsts.append(first)
    assert firsts[0] == firsts[1]
    assert whole.stats["prefill_chunks"] == 1 and chunked.stats["prefill_chunks"] == 5  # 5+5+5+5+3


def test_decode_preempts_when_blocks_run_out_and_recomputes_to_the_same_tokens():
    params = greedy(10)
    prompts = [prompt(6, offset=i) for i in range(3)]
    reference_runner = make_runner(block_size=4)
    expected = [generate(reference_runner, make_pool(reference_runner), p, params)[0] for p in prompts]
    runner = make_runner(num_blocks=9, block_size=4)  # 3 requests x 4 blocks needed: not enough
    decode = DecodeEngine(runner, make_pool(runner))
    chunks = []
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        decode.add(decode_job(rid, len(p), params), 0.0)
        decode.begin_kv(rid, len(p), runner.config.num_layers, p)
        blocks = decode.requests[rid].blocks
        first = int(torch.argmax(runner.prefill(p, blocks, 0)))  # stands in for the prefill node
        decode.requests[rid].layer_tokens = [len(p)] * runner.config.num_layers
        chunks += decode.commit_kv(rid, first)
    tokens, _ = run_decode(decode, chunks)
    by_request = {f"r{i}": [] for i in range(3)}
    for chunk in chunks:
        by_request[chunk.request_id] += chunk.token_ids
    assert [by_request[f"r{i}"] for i in range(3)] == expected
    assert decode.stats["preemptions"] >= 1 and decode.stats["recomputed_tokens"] > 0
    assert decode.pool.num_free == decode.pool.num_blocks


def test_cancel_frees_a_running_request_at_once():
    runner = make_runner()
    decode = DecodeEngine(runner, make_pool(runner))
    decode.add(decode_job("c", 4), 0.0)
    decode.begin_kv("c", 4, runner.config.num_layers)
    assert decode.pool.num_free < decode.pool.num_blocks
    assert decode.abort("c", "abort").finish_reason == "abort"
    assert decode.pool.num_free == decode.pool.num_blocks and not decode.has_work


def test_top_k_one_is_greedy_and_seeded_sampling_repeats():
    from kvcentric.engine.model.sampling import sample
    logits = torch.randn(258, generator=torch.Generator().manual_seed(0))
    top1 = SamplingParams(temperature=1.5, top_k=1, seed=3)
    assert sample(logits, top1, 0) == int(torch.argmax(logits))
    seeded = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=11)
    draws = [sample(logits, seeded, step) for step in range(5)]
    assert draws == [sample(logits, seeded, step) for step in range(5)]
    allowed = set(torch.topk(logits, 20).indices.tolist())
    assert set(draws) <= allowed


def test_colocated_engine_interleaves_chunks_and_decode_and_matches_single_requests():
    params = greedy(9)
    engine, expected = colocated_with_prompts(params)
    out = {f"c{i}": [] for i in range(3)}
    while engine.has_work:
        for chunk in engine.step():
            out[chunk.request_id] += chunk.token_ids
    assert [out[f"c{i}"] for i in range(3)] == expected
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.decode.stats["kv_bytes_received"] == 0  # nothing moved: the blocks were handed over


def test_abort_during_a_step_keeps_the_blocks_until_the_step_ends():
    runner = make_runner()
    decode = DecodeEngine(runner, make_pool(runner))
    for rid in ("a", "b"):
        decode.add(decode_job(rid, 4), 0.0)
        decode.begin_kv(rid, 4, runner.config.num_layers, [256, 1, 2, 3])
        decode.requests[rid].layer_tokens = [4] * runner.config.num_layers
        decode.commit_kv(rid, 5)
    batch, _ = decode.schedule()
    decode.abort("a", "abort")  # the client left while the step runs in the model thread
    tokens = decode.execute(batch)  # must still see a's blocks
    chunks = decode.update(batch, tokens)
    assert [c.request_id for c in chunks] == ["b"]
    decode.abort("b", "abort")
    assert decode.pool.num_free == decode.pool.num_blocks


def test_a_failed_step_ends_its_requests_and_frees_their_blocks():
    runner = make_runner()
    decode = DecodeEngine(runner, make_pool(runner))
    decode.add(decode_job("x", 4), 0.0)
    decode.begin_kv("x", 4, runner.config.num_layers)
    decode.requests["x"].layer_tokens = [4] * runner.config.num_layers
    decode.commit_kv("x", 5)
    batch, _ = decode.schedule()
    [chunk] = decode.fail_step(batch, "boom")
    assert chunk.finish_reason == "error" and decode.pool.num_free == decode.pool.num_blocks
