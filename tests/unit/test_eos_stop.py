"""Stopping at EOS: the rule (`core/stopping.py`) on its own, then greedy generation on a tiny random
checkpoint whose EOS is a token greedy decoding produces early, which must stop exactly where `transformers`
`generate` stops, with the same tokens, in one process and through the prefill -> decode and colocated
engines. Every other test sets ignore_eos; these do not."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints import build_checkpoint, hf_model
from factories import decode_job, prefill_job
from kvcentric.core.block_pool import BlockPool
from kvcentric.engine.cores.colocated import ColocatedEngine
from kvcentric.engine.cores.decode import DecodeEngine
from kvcentric.engine.model.local import generate
from kvcentric.engine.cores.prefill import PrefillEngine
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.core.stopping import finish_reason
from kvcentric.core.hashing import BlockHasher
from kvcentric.model.config import load_model_config
from kvcentric.core.protocol import SamplingParams
from test_model_and_engines import handoff

EOS = 2
MAX_TOKENS = 16
BLOCK_SIZE = 4


# ---------------------------------------------------------------- the rule


def params(**settings) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 8, **settings})


def test_the_eos_token_stops_with_reason_stop():
    assert finish_reason(EOS, 1, params(), EOS) == "stop"
    assert finish_reason(EOS, 5, params(), EOS) == "stop"


def test_other_tokens_go_on_until_max_tokens():
    assert [finish_reason(7, n, params(), EOS) for n in range(1, 8)] == [None] * 7
    assert finish_reason(7, 8, params(), EOS) == "length"


def test_eos_on_the_last_allowed_token_is_a_stop_not_a_length():
    assert finish_reason(EOS, 8, params(), EOS) == "stop"


def test_ignore_eos_goes_past_eos_until_max_tokens():
    assert finish_reason(EOS, 1, params(ignore_eos=True), EOS) is None
    assert finish_reason(EOS, 8, params(ignore_eos=True), EOS) == "length"


def test_a_stop_token_stops_even_with_ignore_eos():
    stop = params(stop_token_ids=[11, 12], ignore_eos=True)
    assert finish_reason(12, 1, stop, EOS) == "stop" and finish_reason(11, 8, stop, EOS) == "stop"
    assert finish_reason(13, 1, stop, EOS) is None and finish_reason(EOS, 1, stop, EOS) is None


def test_eos_is_the_model_s_own_id():
    assert finish_reason(EOS, 1, params(), eos_token_id=3) is None
    assert finish_reason(3, 1, params(), eos_token_id=3) == "stop"


def test_a_model_without_eos_stops_only_at_max_tokens():
    assert all(finish_reason(token, 1, params(), eos_token_id=-1) is None for token in (0, 1, 2, 257))


def test_max_tokens_one_stops_after_the_first_token():
    assert finish_reason(7, 1, params(max_tokens=1), EOS) == "length"


# ---------------------------------------------------------------- against transformers


PROMPT = [1] + torch.randint(3, 300, (11,), generator=torch.Generator().manual_seed(5)).tolist()
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def runner_for(directory) -> tuple[ModelRunner, BlockPool]:
    return ModelRunner(load_model_config(str(directory)), 64, BLOCK_SIZE), BlockPool(64, BLOCK_SIZE)


def hf_greedy(model, **generate_settings) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0,
                             **generate_settings)
    return out[0, len(PROMPT):].tolist()


def first_new_token_at(tokens: list[int], index: int) -> int:
    """The first position from `index` on whose token has not appeared before it, so that making it EOS
    ends greedy generation exactly there."""
    return next(i for i in range(index, len(tokens)) if tokens[i] not in tokens[:i])


@pytest.fixture(scope="module")
def free_run(tmp_path_factory) -> list[int]:
    """Greedy tokens of the checkpoint with EOS = 2, run to MAX_TOKENS (ignore_eos)."""
    directory = build_checkpoint(tmp_path_factory.mktemp("eos-free"), "llama")
    runner, pool = runner_for(directory)
    tokens, reason = generate(runner, pool, PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert reason == "length" and len(set(tokens)) > 3, "greedy repeats one token: pick another prompt"
    return tokens


@pytest.fixture(scope="module", params=[0, 2], ids=["eos-first", "eos-third"])
def stopping(request, free_run, tmp_path_factory):
    """The same weights (same seed) rebuilt with EOS = the token greedy decoding produces at a position
    (0: the prefill's own token), and where generation must stop."""
    at = first_new_token_at(free_run, request.param)
    eos = free_run[at]
    directory = build_checkpoint(tmp_path_factory.mktemp(f"eos-{eos}"), "llama", eos_token_id=eos)
    assert load_model_config(str(directory)).eos_token_id == eos
    return directory, eos, free_run[:at + 1]


def test_transformers_stops_at_the_chosen_eos(stopping):
    directory, eos, expected = stopping
    assert hf_greedy(hf_model(directory)) == expected and expected[-1] == eos


def test_greedy_generation_stops_where_transformers_stops(stopping):
    directory, _, expected = stopping
    runner, pool = runner_for(directory)
    tokens, reason = generate(runner, pool, PROMPT, GREEDY)
    assert (tokens, reason) == (expected, "stop")
    assert tokens == hf_greedy(hf_model(directory))
    assert pool.num_free == pool.num_blocks


def test_ignore_eos_runs_past_it_to_max_tokens(stopping, free_run):
    directory, _, expected = stopping
    runner, pool = runner_for(directory)
    tokens, reason = generate(runner, pool, PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert (tokens, reason) == (free_run, "length") and len(tokens) > len(expected)


def test_prefill_and_decode_engines_stop_at_eos_with_the_same_tokens(stopping):
    directory, _, expected = stopping
    (p_runner, p_pool), (d_runner, d_pool) = runner_for(directory), runner_for(directory)
    prefill = PrefillEngine(p_runner, p_pool, BlockHasher(block_size=BLOCK_SIZE), chunk_tokens=8)
    decode = DecodeEngine(d_runner, d_pool)
    job = prefill_job(PROMPT, GREEDY)
    prefill.submit(job)
    tokens, last = handoff(prefill, decode, job, GREEDY)
    assert tokens == expected
    assert last.finish_reason == "stop" and last.completion_tokens == len(expected)
    assert not decode.has_work and decode.pool.num_free == decode.pool.num_blocks


def test_the_colocated_engine_stops_at_eos_with_the_same_tokens(stopping):
    directory, _, expected = stopping
    runner, pool = runner_for(directory)
    engine = ColocatedEngine(runner, pool, BlockHasher(block_size=BLOCK_SIZE), chunk_tokens=8)
    job = prefill_job(PROMPT, GREEDY)
    engine.submit(job, decode_job(job.request_id, len(PROMPT), GREEDY))
    chunks = []
    while engine.has_work:
        chunks += engine.step()
    assert [t for c in chunks for t in c.token_ids] == expected and chunks[-1].finish_reason == "stop"
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_stop_token_id_stops_where_transformers_stops_on_that_id(free_run, tmp_path_factory):
    """stop_token_ids against transformers' list of EOS ids: EOS 2 and the stop token."""
    directory = build_checkpoint(tmp_path_factory.mktemp("eos-stop-id"), "llama")
    at = first_new_token_at(free_run, 4)
    stop = free_run[at]
    runner, pool = runner_for(directory)
    tokens, reason = generate(runner, pool, PROMPT, SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[stop]))
    assert (tokens, reason) == (free_run[:at + 1], "stop")
    assert tokens == hf_greedy(hf_model(directory), eos_token_id=[EOS, stop])


def test_a_checkpoint_listing_several_eos_ids_stops_on_any_of_them(free_run, tmp_path_factory):
    at = first_new_token_at(free_run, 2)
    directory = build_checkpoint(tmp_path_factory.mktemp("eos-list"), "llama", eos_token_id=[EOS, free_run[at]])
    assert json.loads((directory / "config.json").read_text())["eos_token_id"] == [EOS, free_run[at]]
    expected = hf_greedy(hf_model(directory))
    assert expected == free_run[:at + 1]
    runner, pool = runner_for(directory)
    assert generate(runner, pool, PROMPT, GREEDY) == (expected, "stop")
