"""n > 1 from one prefill: the sequences fork in the decode engine, sharing the prompt's full blocks (their
reference counts) and copying its partial last block; each draws from its own seeded stream."""

from __future__ import annotations

import collections

import msgspec
import pytest

from factories import make_pool, make_runner, prefill_job, prompt
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.protocol import DecodeJob, SamplingParams
from kvcentric.engine.cores.colocated import ColocatedEngine

SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)


def run(engine: ColocatedEngine, token_ids: list[int], params: SamplingParams) -> dict[int, list[int]]:
    job = prefill_job(token_ids, params)
    engine.submit(job, DecodeJob(request_id=job.request_id, n_prompt_tokens=len(token_ids), sampling=params))
    tokens: dict[int, list[int]] = collections.defaultdict(list)
    finished = set()
    while len(finished) < params.n:
        for chunk in engine.step():
            tokens[chunk.index] += chunk.token_ids
            if chunk.finish_reason is not None:
                finished.add(chunk.index)
    return dict(tokens)


@pytest.mark.parametrize("length", [9, 8])  # a partial last prompt block, and none
def test_n_sequences_share_the_prompt_and_the_first_one_is_the_n1_answer(length):
    runner = make_runner(block_size=4)
    pool = make_pool(runner)
    engine = ColocatedEngine(runner, pool, BlockHasher(block_size=4))
    single = run(engine, prompt(length), SEEDED)
    several = run(engine, prompt(length, offset=1), msgspec.structs.replace(SEEDED, n=3))
    assert sorted(several) == [0, 1, 2] and all(len(t) == 6 for t in several.values())
    reference = ColocatedEngine(make_runner(block_size=4), make_pool(runner), BlockHasher(block_size=4))
    assert run(reference, prompt(length, offset=1), SEEDED)[0] == several[0]
    assert len({tuple(t) for t in several.values()}) > 1  # each sequence draws its own tokens
    assert engine.decode.stats["sequences_forked"] == 2 and single
    assert pool.ref_counts == [0] * pool.num_blocks and pool.num_free == pool.num_blocks  # every reference dropped
    assert engine.prefill.stats["requests_prefilled"] == 2  # one prefill per request, not per sequence


@pytest.mark.parametrize("params", [SEEDED, msgspec.structs.replace(SEEDED, temperature=0.7, top_k=20, top_p=0.9,
                                                                      presence_penalty=0.5)])
def test_n_sequences_drawn_together_take_the_tokens_each_draws_alone(params):
    """Without logprobs a prompt's n first tokens are drawn together (`draw_rows`), as are a decode step's rows;
    with logprobs each is drawn alone (`choose`): the logprobs change no token, so both give the same sequences."""
    runner = make_runner(block_size=4)
    engine = ColocatedEngine(runner, make_pool(runner), BlockHasher(block_size=4))
    together = run(engine, prompt(9), msgspec.structs.replace(params, n=4))
    alone = run(engine, prompt(9), msgspec.structs.replace(params, n=4, logprobs=1))
    assert together == alone and len({tuple(t) for t in together.values()}) > 1


def test_greedy_sequences_agree_with_each_other_and_with_a_fork_of_a_full_block():
    runner = make_runner(block_size=4)
    engine = ColocatedEngine(runner, make_pool(runner), BlockHasher(block_size=4))
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=2)
    out = run(engine, prompt(8), greedy)
    assert out[0] == out[1] == run(engine, prompt(8), msgspec.structs.replace(greedy, n=1))[0]


def test_guided_sequences_follow_their_grammar_through_prefill_and_decode_steps():
    """A choice's grammar through the colocated engine (the first token sampled by prefill, the rest by decode
    steps), each of n sequences on its own, and the matchers dropped once the sequences end."""
    from kvcentric.core.structured import parse_guide
    from kvcentric.model.tokenizer import ByteTokenizer

    runner = make_runner(block_size=4)
    engine = ColocatedEngine(runner, make_pool(runner), BlockHasher(block_size=4))
    guide = parse_guide({"guided_choice": ["alpha", "beta", "gamma delta"]})
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, n=4, guide=guide)
    out = run(engine, prompt(9), params)
    texts = [ByteTokenizer().decode([t for t in out[i] if t != 257]) for i in range(4)]
    assert set(texts) <= {"alpha", "beta", "gamma delta"} and all(out[i][-1] == 257 for i in range(4))
    assert not engine.decode.guides.matchers and not engine.prefill.guides.matchers
