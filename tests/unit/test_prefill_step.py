"""Prefill steps over several prompts (`PrefillEngine.schedule_step` / `execute_step`): chunks of as many prompts
as the token budget holds computed in one pass give every prompt the first token and the KV (as its layer hook
sees it, and in the cache) that computing it alone gives; prompts that need every row or a layer-wise prefix
load run alone; budget 0 is one chunk per pass."""

from __future__ import annotations

import torch

from factories import make_pool, make_runner, prompt
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.protocol import PrefillJob, SamplingParams
from kvcentric.engine.cores.prefill import PrefillChunk, PrefillEngine

LENGTHS = (9, 30, 17, 44, 5)


def job(index: int, length: int, **sampling) -> PrefillJob:
    return PrefillJob(request_id=f"r{index}", token_ids=prompt(length, offset=7 * index),
                      sampling=SamplingParams(max_tokens=4, temperature=0.0, **sampling), decode_id="",
                      decode_kv_addr="")


def engine(chunk_tokens: int = 16) -> PrefillEngine:
    runner = make_runner(num_blocks=128, block_size=4)
    return PrefillEngine(runner, make_pool(runner), BlockHasher("sha256_cbor", 4), chunk_tokens)


def recording(chunk: PrefillChunk, seen: dict[str, dict[int, list[torch.Tensor]]]):
    """A layer hook that keeps the keys it is handed for the chunk's request."""
    def hook(layer: int, keys, values) -> None:
        assert keys.shape[0] == chunk.end - chunk.start
        seen.setdefault(chunk.work.request_id, {}).setdefault(layer, []).append(keys.clone())
    return hook


def run(prefill: PrefillEngine, budget: int, jobs: list[PrefillJob]):
    """Every job to its first token; per request: first token, the keys its hook saw per layer (in order),
    its cached KV of every position, and the number of passes taken."""
    for each in jobs:
        prefill.submit(each)
    firsts: dict[str, int] = {}
    seen: dict[str, dict[int, list[torch.Tensor]]] = {}
    kv: dict[str, torch.Tensor] = {}
    passes = 0
    while chunks := prefill.schedule_step(budget):
        passes += 1
        tokens = prefill.execute_step(chunks, [recording(c, seen) for c in chunks])
        for chunk, token in zip(chunks, tokens):
            prefill.update(chunk)
            assert (token is not None) == chunk.last
            if chunk.last:
                work = chunk.work
                firsts[work.request_id] = token
                kv[work.request_id] = torch.stack([torch.stack(prefill.runner.layer_kv(layer, work.blocks, 0,
                                                                                        work.num_tokens))
                                                   for layer in range(prefill.runner.config.num_layers)])
                prefill.complete(work)
                prefill.finish(work)
    assert not prefill.running and not prefill.sending and not prefill.queue
    return firsts, {r: {layer: torch.cat(k) for layer, k in layers.items()} for r, layers in seen.items()}, kv, passes


def test_several_prompts_in_one_pass_give_each_what_it_gets_alone():
    jobs = [job(i, n) for i, n in enumerate(LENGTHS)]
    alone = run(engine(), 0, jobs)
    together = run(engine(), 64, jobs)
    assert together[0] == alone[0]
    for request in alone[1]:
        for layer in alone[1][request]:
            torch.testing.assert_close(together[1][request][layer], alone[1][request][layer], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(together[2][request], alone[2][request], atol=1e-5, rtol=1e-4)
    assert alone[3] == sum(-(-n // 16) for n in LENGTHS)  # one chunk of one prompt per pass
    assert together[3] < alone[3]


def test_the_budget_bounds_a_pass_and_chunks_stay_within_the_chunk_size():
    prefill = engine(chunk_tokens=16)
    for index, length in enumerate(LENGTHS):
        prefill.submit(job(index, length))
    chunks = prefill.schedule_step(40)
    assert [c.end - c.start for c in chunks] == [9, 16, 15]  # r0 whole, r1's first chunk, r2 cut at the budget
    assert [c.work.request_id for c in chunks] == ["r0", "r1", "r2"]
    assert sum(c.end - c.start for c in chunks) == 40
    assert len(prefill.schedule_step(0)) == 1


def test_a_prompt_asking_for_prompt_logprobs_runs_alone():
    prefill = engine()
    prefill.submit(job(0, 9))
    prefill.submit(job(1, 12, prompt_logprobs=0))
    prefill.submit(job(2, 6))
    first = prefill.schedule_step(64)
    assert [c.work.request_id for c in first] == ["r0"]  # r1 started, not batched: it needs every row
    prefill.execute_step(first, [None])
    prefill.update(first[0])
    prefill.complete(first[0].work)
    second = prefill.schedule_step(64)
    assert [c.work.request_id for c in second] == ["r1"]
