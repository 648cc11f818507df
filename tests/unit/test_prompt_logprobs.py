"""Prompt logprobs from the prefill: the same whatever the chunking, never from a cached prefix, and handed
to decode with the first token (the KV commit's extras) to leave in the request's first chunk."""

from __future__ import annotations

import pytest

from factories import decode_job, make_pool, make_runner, prefill_job, prompt
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.protocol import SamplingParams
from kvcentric.engine.cores.decode import DecodeEngine
from kvcentric.engine.cores.prefill import PrefillEngine

SCORED = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)


def prefill_all(engine: PrefillEngine, token_ids: list[int], params: SamplingParams):
    engine.submit(prefill_job(token_ids, params))
    while (chunk := engine.schedule()) is not None:
        first = engine.execute(chunk)
        engine.update(chunk)
        if chunk.last:
            work = chunk.work
            engine.finish(work)
            return first, work


def test_prompt_logprobs_do_not_depend_on_chunking_and_skip_the_cache():
    runner = make_runner(block_size=4)
    tokens = prompt(23)
    whole = PrefillEngine(runner, make_pool(runner), BlockHasher(block_size=4), chunk_tokens=1000)
    chunked = PrefillEngine(runner, make_pool(runner), BlockHasher(block_size=4), chunk_tokens=5)
    first, scored = prefill_all(whole, tokens, SCORED)
    again_first, again = prefill_all(whole, tokens, SCORED)  # its blocks are cached now
    chunked_first, pieces = prefill_all(chunked, tokens, SCORED)
    assert len(scored.prompt_logprobs) == len(tokens) - 1 and again.num_cached == 0
    assert [e.token_id for e in scored.prompt_logprobs] == tokens[1:]
    for entries in (again.prompt_logprobs, pieces.prompt_logprobs):
        assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in scored.prompt_logprobs], abs=1e-5)
    assert first == again_first == chunked_first and scored.first_logprob.rank == 1
    unscored = SamplingParams(max_tokens=3, temperature=0.0)
    _, cached = prefill_all(whole, tokens, unscored)
    assert cached.num_cached > 0 and cached.prompt_logprobs == [] and cached.first_token_extras() == b""


def test_decode_sends_the_prefills_logprobs_in_the_first_chunk():
    runner = make_runner(block_size=4)
    tokens = prompt(10)
    first, work = prefill_all(PrefillEngine(runner, make_pool(runner), BlockHasher(block_size=4)), tokens, SCORED)
    decode = DecodeEngine(runner, make_pool(runner))
    decode.add(decode_job("r", len(tokens), SCORED), 0.0)
    decode.begin_kv("r", len(tokens), runner.config.num_layers, tokens)
    blocks = decode.requests["r"].blocks
    runner.prefill(tokens, blocks, 0)  # stands in for the pushed KV
    decode.requests["r"].layer_tokens = [len(tokens)] * runner.config.num_layers
    [chunk] = decode.commit_kv("r", first, work.first_token_extras())
    assert chunk.token_ids == [first] and chunk.logprobs == [work.first_logprob]
    assert chunk.prompt_logprobs == work.prompt_logprobs
    batch, _ = decode.schedule()
    [after] = decode.update(batch, decode.execute(batch))
    assert len(after.logprobs) == 1 and after.logprobs[0].token_id == after.token_ids[0]
    assert after.prompt_logprobs == []
