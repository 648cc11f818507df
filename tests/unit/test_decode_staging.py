"""KV that arrives at a full decode instance waits in host staging and joins when blocks free; with staging
full too it is refused as overload (KVNoRoom, a 429), and nothing leaks either way."""

from __future__ import annotations

import pytest

from factories import decode_job, greedy, make_pool, make_runner
from kvcentric.engine.cores.decode import DecodeEngine, KVNoRoom


def engine_with(num_blocks: int, staging_requests: int) -> DecodeEngine:
    runner = make_runner(num_blocks=num_blocks)
    size = 8 * 2 * runner.config.num_layers * runner.layer_token_bytes
    return DecodeEngine(runner, make_pool(runner), staging_bytes=staging_requests * size)


def arrive(engine: DecodeEngine, request_id: str, max_tokens: int = 4, n_tokens: int = 8):
    """Add a request and push its whole prompt KV (zeros), then commit it."""
    engine.add(decode_job(request_id, n_tokens, params=greedy(max_tokens)), 0.0)
    engine.begin_kv(request_id, n_tokens, engine.runner.config.num_layers, list(range(n_tokens)))
    nbytes = n_tokens * engine.runner.layer_token_bytes
    for layer in range(engine.runner.config.num_layers):
        engine.write_kv(request_id, layer, 0, n_tokens, bytes(nbytes), bytes(nbytes))
    return engine.commit_kv(request_id, 1)


def run_until_idle(engine: DecodeEngine) -> list[str]:
    """Step until nothing is left; the requests in the order they finished."""
    finished: list[str] = []
    for _ in range(200):
        if not engine.has_work:
            break
        batch, failed = engine.schedule()
        assert not failed
        if batch:
            chunks = engine.update(batch, engine.execute(batch))
            finished += [c.request_id for c in chunks if c.finish_reason]
    return finished


def test_kv_for_a_full_cache_waits_on_the_host_and_runs_once_blocks_free():
    engine = engine_with(num_blocks=3, staging_requests=2)  # 8 prompt tokens + 1 need 3 blocks of 4
    arrive(engine, "a")
    first = arrive(engine, "b")
    assert first[0].token_ids == [1]  # its first token goes out at once
    assert engine.requests["b"].state == "preempted" and engine.stats["kv_staged"] == 1
    assert engine.kv.staging_used > 0
    run_until_idle(engine)
    assert not engine.requests and engine.stats["requests_finished"] == 2
    assert engine.stats["recomputed_tokens"] == 0  # loaded from staging, not recomputed
    assert engine.pool.num_free == engine.pool.num_blocks and engine.kv.staging_used == 0


def test_kv_is_refused_as_overload_when_staging_is_full_too():
    engine = engine_with(num_blocks=3, staging_requests=1)
    arrive(engine, "a")
    arrive(engine, "b")
    engine.add(decode_job("c", 8, params=greedy(4)), 0.0)
    with pytest.raises(KVNoRoom, match="decode instance full"):
        engine.begin_kv("c", 8, engine.runner.config.num_layers, list(range(8)))
    chunk = engine.abort("c", "error", "full", status=429)
    assert chunk is not None and chunk.error_status == 429
    run_until_idle(engine)
    assert engine.pool.num_free == engine.pool.num_blocks and engine.kv.staging_used == 0


def test_aborting_a_staged_request_frees_its_staging():
    engine = engine_with(num_blocks=3, staging_requests=1)
    arrive(engine, "a")
    arrive(engine, "b")
    engine.abort("b", "abort")
    assert engine.kv.staging_used == 0
    run_until_idle(engine)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_the_newest_running_request_is_preempted_when_blocks_run_out():
    engine = engine_with(num_blocks=6, staging_requests=0)  # two prompts fit, not their growth
    arrive(engine, "old", max_tokens=8)
    arrive(engine, "new", max_tokens=8)
    assert run_until_idle(engine) == ["old", "new"]  # "new" gave its blocks up and was recomputed
    assert engine.stats["preemptions"] >= 1 and engine.stats["recomputed_tokens"] > 0
    assert engine.pool.num_free == engine.pool.num_blocks
