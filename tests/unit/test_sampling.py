"""The sampler: vLLM's penalties, min_tokens and logit_bias on the logits, and logprobs raw or processed."""

from __future__ import annotations

import pytest
import torch

from kvcentric.core.protocol import SamplingParams
from kvcentric.engine.model.sampling import adjust, choose, prompt_logprobs

LOGITS = torch.tensor([2.0, -1.0, 0.5, 1.0, -3.0])


def adjusted(prompt=(), generated=(), stop_ids=(), **params) -> list[float]:
    return adjust(LOGITS.clone(), SamplingParams(**params), prompt, generated, stop_ids).tolist()


def test_nothing_asked_leaves_the_logits_alone():
    assert adjusted(generated=[0, 0]) == LOGITS.tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    assert adjusted(prompt=[0], generated=[1], repetition_penalty=2.0) == [1.0, -2.0, 0.5, 1.0, -3.0]


@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0])
def test_a_repetition_penalty_near_zero_leaves_finite_logits_and_a_token(temperature):
    params = SamplingParams(temperature=temperature, seed=3, repetition_penalty=5e-324, logprobs=2,
                            processed_logprobs=True)
    assert all(abs(v) < float("inf") for v in adjust(LOGITS.clone(), params, [0, 3], [], ()).tolist())
    token, logprob = choose(LOGITS.clone(), params, 0, prompt=[0, 3])
    assert token in (0, 3) and logprob is not None and logprob.logprob == logprob.logprob  # not NaN
    allowed = torch.tensor([False, False, False, True, False])  # a grammar's mask: the others at -inf, seen too
    token, _ = choose(LOGITS.clone(), params, 0, prompt=[0, 1, 3], allowed=allowed)
    assert token == 3


def test_frequency_and_presence_penalties_count_the_output_only():
    got = adjusted(prompt=[2], generated=[0, 0, 3], frequency_penalty=0.5, presence_penalty=0.25)
    assert got == pytest.approx([2.0 - 1.0 - 0.25, -1.0, 0.5, 1.0 - 0.5 - 0.25, -3.0])


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    held = adjusted(generated=[1], stop_ids={0}, min_tokens=2, stop_token_ids=[3])
    assert held[0] == held[3] == float("-inf") and held[2] == 0.5
    assert adjusted(generated=[1, 1], stop_ids={0}, min_tokens=2) == LOGITS.tolist()
    assert adjusted(generated=[1], stop_ids={0}, min_tokens=2, ignore_eos=True) == LOGITS.tolist()


def test_logit_bias_adds_and_ignores_ids_beyond_the_vocabulary():
    assert adjusted(logit_bias={4: 10.0, 99: 5.0}) == [2.0, -1.0, 0.5, 1.0, 7.0]


def test_greedy_picks_the_biased_token_and_logprobs_are_raw_unless_processed_is_asked():
    params = SamplingParams(temperature=0.0, logit_bias={4: 10.0}, logprobs=2)
    token, raw = choose(LOGITS, params, 0)
    assert token == 4 and raw is not None
    assert raw.logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[4])) and raw.rank == 5
    assert raw.top_ids == [0, 3]
    _, processed = choose(LOGITS, SamplingParams(temperature=0.0, logit_bias={4: 10.0}, logprobs=0,
                                                 processed_logprobs=True), 0)
    assert processed is not None and processed.rank == 1 and processed.top_ids == []


def test_processed_logprobs_apply_the_temperature():
    params = SamplingParams(temperature=0.5, seed=1, logprobs=1, processed_logprobs=True)
    token, entry = choose(LOGITS, params, 0)
    assert entry is not None
    assert entry.logprob == pytest.approx(float(torch.log_softmax(LOGITS / 0.5, -1)[token]))


def test_a_seed_makes_penalised_sampling_repeat():
    params = SamplingParams(temperature=1.0, seed=5, frequency_penalty=1.0, repetition_penalty=1.3)
    draws = [choose(LOGITS, params, step, [1], [0, 2][:step])[0] for step in range(3)]
    assert draws == [choose(LOGITS, params, step, [1], [0, 2][:step])[0] for step in range(3)]


def test_prompt_logprobs_score_each_next_token_from_the_row_before():
    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    entries = prompt_logprobs(rows, [3, 4], 1)
    table = torch.log_softmax(rows, -1)
    assert [e.logprob for e in entries] == pytest.approx([float(table[0, 3]), float(table[1, 4])])
    assert [e.top_ids for e in entries] == [[0], [4]] and [e.rank for e in entries] == [2, 1]


def test_a_batch_picks_the_tokens_row_by_row_choice_picks():
    """`BatchSampler.choose_all` (a decode engine's `sampler`) takes one argmax over the plain greedy rows and
    `choose` for the rest: the same tokens, and the logprobs of the rows that asked, as choosing each row alone."""
    from factories import decode_job, make_pool, make_runner
    from kvcentric.engine.cores.decode import DecodeEngine
    from kvcentric.engine.cores.sequence import DecodeRequest
    from kvcentric.engine.model.sampling import plain_greedy

    kinds = [SamplingParams(max_tokens=4, temperature=0.0),
             SamplingParams(max_tokens=4, temperature=0.0, logprobs=2),
             SamplingParams(max_tokens=4, temperature=0.8, seed=3),
             SamplingParams(max_tokens=4, temperature=0.0, min_tokens=3),
             SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3),
             SamplingParams(max_tokens=4, temperature=0.0),
             SamplingParams(max_tokens=4, temperature=1.3, seed=5, top_k=7),
             SamplingParams(max_tokens=4, temperature=0.8, seed=3, top_p=0.5, presence_penalty=1.5),
             SamplingParams(max_tokens=4, temperature=0.8, seed=9, min_tokens=3, logit_bias={7: 40.0}),
             SamplingParams(max_tokens=4, temperature=0.8)]  # (unseeded: drawn, but any token)
    assert [plain_greedy(p) for p in kinds] == [True, False, False, False, False, True, False, False, False, False]
    runner = make_runner()
    engine = DecodeEngine(runner, make_pool(runner))
    logits = torch.randn(len(kinds), runner.config.vocab_size, generator=torch.Generator().manual_seed(1))
    batch = [DecodeRequest(decode_job(f"r{i}", 5, params), deadline=0.0, prompt=[1, 2, 3, 4, 5], generated=[7])
             for i, params in enumerate(kinds)]
    expected = [engine.sampler.choose(logits[row], request) for row, request in enumerate(batch)]
    expected_logprobs = [request.next_logprob for request in batch]
    picked = engine.sampler.choose_all(logits, batch)
    assert picked[:-1] == expected[:-1] and 0 <= picked[-1] < runner.config.vocab_size
    assert expected[8] == 7  # the bias won
    assert [request.next_logprob for request in batch] == expected_logprobs
    assert engine.sampler.choose_all(logits[[0, 5]], [batch[0], batch[5]]) == [expected[0], expected[5]]  # all plain


def test_rows_drawn_together_take_the_tokens_each_takes_alone_and_multinomial_took():
    """`draw_rows` (a batch's rows in a few ops, each with its own temperature, top-k, top-p, seed, step and
    sequence) gives each row the token `draw` gives it alone, and that token is the one torch.multinomial drew from
    the same seeded generator (the exponential race is how it draws one sample), so seeded outputs did not change
    when the draws were batched."""
    from kvcentric.engine.model.sampling import SEQUENCE_STRIDE, draw, draw_rows, top_k_top_p

    generator = torch.Generator().manual_seed(0)
    for case in range(60):
        rows, vocab = 1 + case % 9, (258, 1000, 4096)[case % 3]
        logits = torch.randn(rows, vocab, generator=generator) * (1 + case % 4)
        if case % 2:  # a grammar's mask: most tokens refused
            logits[torch.rand(rows, vocab, generator=generator) < 0.9] = float("-inf")
        params = [SamplingParams(temperature=(0.0, 0.3, 0.7, 1.0, 1.6)[(case + row) % 5], seed=case * 31 + row,
                                 top_k=(0, 0, 5)[row % 3], top_p=(1.0, 0.9)[(case + row) % 2]) for row in range(rows)]
        steps, sequences = [case + 3 * row for row in range(rows)], [row % 3 for row in range(rows)]
        together = draw_rows(logits, params, steps, sequences)
        assert together == [draw(logits[row], params[row], steps[row], sequences[row]) for row in range(rows)]
        for row, p in enumerate(params):
            if p.temperature > 0:
                probs = torch.softmax(logits[row] / p.temperature, dim=-1)
                if p.top_k or p.top_p < 1:
                    probs = top_k_top_p(probs, p)
                seeded = torch.Generator().manual_seed((p.seed * 1_000_003 + steps[row]
                                                        + sequences[row] * SEQUENCE_STRIDE) % 2 ** 64)
                assert together[row] == int(torch.multinomial(probs, 1, generator=seeded)), (case, row)


def test_a_row_that_is_no_distribution_raises_as_multinomial_did():
    from kvcentric.engine.model.sampling import draw_rows

    logits = torch.zeros(2, 8)
    logits[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match="not one"):
        draw_rows(logits, [SamplingParams(temperature=1.0, seed=1)] * 2, [0, 0], [0, 0])
    assert draw_rows(logits[:1], [SamplingParams(temperature=1.0, seed=1)], [0], [0])[0] in range(8)
