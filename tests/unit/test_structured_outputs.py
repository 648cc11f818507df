"""Structured outputs: what the API asks for becomes one llguidance grammar (a 400 when it cannot be enforced),
and the engines' sampler, masked by it step after step, only ever produces text the grammar accepts, for a
random model sampling at temperature 1; a sequence's grammar state is rebuilt from its output anywhere."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from llguidance import LLMatcher, LLParserLimits

from kvcentric.core.openai_api import ApiError, parse_chat, parse_completion
from kvcentric.core.protocol import SamplingParams
from kvcentric.core.structured import parse_guide
from kvcentric.engine.model.guided import Guides
from kvcentric.engine.cores.decode_sampling import takes_forced
from kvcentric.engine.model.sampling import choose
from kvcentric.model.config import PRESETS
from kvcentric.model.tokenizer import ByteTokenizer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"type": "string", "maxLength": 6}},
          "required": ["ok", "size", "count", "tag"], "additionalProperties": False}


def generate(guides: Guides, guide: str, seed: int, key: str = "r", limit: int = 200) -> str:
    """Sample a random model's logits under the grammar until EOS; the text."""
    params = SamplingParams(temperature=1.0, seed=seed, guide=guide, max_tokens=limit)
    vocab, generator, output = guides.vocab_size, torch.Generator().manual_seed(seed), []
    for step in range(limit):
        logits = torch.randn(vocab, generator=generator) * 4
        token, _ = choose(logits, params, step, [256], output, {257}, 0, guides.mask(key, params, output))
        if token == 257:
            return ByteTokenizer(vocab).decode(output)
        output.append(token)
    raise AssertionError(f"no EOS in {limit} tokens: {ByteTokenizer(vocab).decode(output)!r}")


@pytest.mark.parametrize("vocab", [258, 32000])
def test_a_random_model_under_a_json_schema_always_gives_json_the_schema_accepts(vocab):
    guides = Guides(dataclasses.replace(PRESETS["tiny"], vocab_size=vocab))  # 32000: word tokens too
    guide = parse_guide({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}})
    for seed in range(8):
        value = json.loads(generate(guides, guide, seed, key=f"r{seed}"))
        assert set(value) == {"ok", "size", "count", "tag"} and isinstance(value["ok"], bool)
        assert value["size"] in "SML" and 0 <= value["count"] <= 99 and len(value["tag"]) <= 6


def test_choice_regex_and_json_object_hold_at_temperature_one():
    guides = Guides(PRESETS["tiny"])
    choice = parse_guide({"structured_outputs": {"choice": ["yes", "no", "a|b", "1+1/2"]}})
    regex = parse_guide({"guided_regex": r"[a-z]{2,5}-[0-9]{3}"})
    anything = parse_guide({"response_format": {"type": "json_object"}})
    for seed in range(6):
        assert generate(guides, choice, seed, key=f"c{seed}") in ("yes", "no", "a|b", "1+1/2")
        assert re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", generate(guides, regex, seed, key=f"x{seed}"))
        assert isinstance(json.loads(generate(guides, anything, seed, key=f"o{seed}", limit=2000)), dict)


def test_a_sequence_replayed_elsewhere_gets_the_same_mask():
    guide = parse_guide({"structured_outputs": {"json": json.dumps(SCHEMA)}})
    kept, elsewhere = Guides(PRESETS["tiny"]), Guides(PRESETS["tiny"])
    output = list(b'{"ok":true,"si')
    for end in range(len(output) + 1):
        first = kept.allowed("r", guide, output[:end])
        assert torch.equal(first, elsewhere.allowed(f"other{end}", guide, output[:end]))
    assert first.nonzero().flatten().tolist() == [ord("z")]
    kept.forget("r")
    assert torch.equal(kept.allowed("r", guide, output), first)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": []}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}}, "response_format"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
])
def test_what_cannot_be_enforced_is_a_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as caught:
        parse_completion({"prompt": "x", **body}, "tiny", 258)
    assert caught.value.status == 400 and caught.value.param == param


def test_text_is_no_constraint_and_every_way_of_asking_reaches_the_sampling_params():
    assert parse_completion({"prompt": "x", "response_format": {"type": "text"}}, "tiny", 258).sampling.guide == ""
    messages = [{"role": "user", "content": "x"}]
    for asked in ({"response_format": {"type": "json_object"}}, {"guided_json": SCHEMA},
                  {"structured_outputs": {"json_object": True}}, {"guided_choice": ["a", "b"]}):
        assert parse_chat({"messages": messages, **asked}, "tiny", 2048).sampling.guide


def test_a_grammar_that_does_not_build_lets_its_sequence_only_end():
    guides = Guides(PRESETS["tiny"])
    assert guides.allowed("k", "not a grammar {", []).nonzero().flatten().tolist() == [257]


def alone(guides: Guides, grammar: str, output: list[int]) -> torch.Tensor:
    """One sequence's mask computed on its own, from a new matcher, as the engines did row by row before."""
    matcher = LLMatcher(guides.tokenizer, grammar)
    matcher.consume_tokens(output)
    if matcher.is_error():
        return guides.only_eos()
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = torch.from_numpy(bits[:guides.vocab_size].astype(bool))
    return allowed if bool(allowed.any()) else guides.only_eos()


@pytest.mark.parametrize("vocab", [258, 32000, 32001])
def test_a_batch_of_sequences_in_different_states_gets_the_masks_each_gets_alone(vocab):
    """`Guides.masks` feeds every row's matcher and computes the batch's masks into one bitmask: each row's is
    the one its sequence gets alone, whatever the others' grammars and states (at the start, mid-string, done,
    refused, a grammar that does not build, a row not guided), on the worker thread (`start`) too, and step
    after step as each matcher (a copy of its grammar's prototype) is fed only its new tokens."""
    guides = Guides(dataclasses.replace(PRESETS["tiny"], vocab_size=vocab), overlap=True)
    schema = parse_guide({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}})
    choice = parse_guide({"guided_choice": ["yes", "no"]})
    regex = parse_guide({"guided_regex": r"[a-z]{2,5}-[0-9]{3}"})
    rows = [("start", schema, []), ("mid", schema, list(b'{"ok":true,"size":"M","count":4')), None,
            ("done", choice, list(b"yes")), ("refused", regex, list(b"ab_")), ("broken", "not a grammar {", []),
            ("regex", regex, list(b"abc-1")), ("again", schema, list(b'{"ok":true,"si'))]
    for step in range(3):
        expected = [None if row is None else alone(guides, row[1], row[2]) for row in rows]
        started = guides.start(rows)
        assert started is not None
        for masks in (guides.masks(rows), started.result()):
            assert masks._allowed is not None  # unpacked where they were computed, the worker (off the CPU)
            assert [mask is None for mask in masks] == [row is None for row in rows]
            assert all(mask is None or torch.equal(mask, want) for mask, want in zip(masks, expected))
        assert all(expected[i].nonzero().flatten().tolist() == [257] for i in (3, 4, 5))  # they may only end
        rows = [row if row is None or row[0] in ("done", "refused", "broken")
                else (row[0], row[1], row[2] + [int(expected[i].nonzero()[-1])]) for i, row in enumerate(rows)]
        rows += [(f"late{step}", schema, list(b'{"ok":fal')), None]
    assert guides.start([None, None]) is None and list(guides.masks([None])) == [None]
    assert set(guides.prototypes) == {schema, choice, regex}  # (the grammar that does not build has none)
    assert Guides(PRESETS["tiny"]).start(rows) is None  # no overlap: `masks` after the forward


def test_masks_from_the_kept_bitmask_never_carry_a_row_over_from_another_row_or_an_earlier_batch():
    """`Guides.masks` writes every batch into one bitmask kept from call to call: as the batch grows and shrinks,
    its rows move, a sequence ends and another takes its place, n sequences of one request part ways and a row in
    error (written as zeros) lands where a wide mask was, each row's mask is the one it gets alone; and the masks a
    call returned stay as they were after later calls."""
    guides = Guides(PRESETS["tiny"])
    schema = parse_guide({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}})
    regex = parse_guide({"guided_regex": r"[a-z]{2,5}-[0-9]{3}"})
    wide, refused = ("wide", schema, list(b'{"ok":true,"size":"M","count":4,"tag":"')), ("refused", regex, list(b"a_"))
    siblings = [(f"q#{i}" if i else "q", schema, list(b'{"ok":' + tail)) for i, tail in enumerate([b"t", b"f", b""])]
    batches = [[wide, *siblings, None, ("ends", regex, list(b"ab-12"))], [refused, None],
               [siblings[2], wide, refused, ("ends", regex, list(b"ab-123")), *siblings[:2], None, wide],
               [wide], [("ends", regex, list(b"cd")), refused, siblings[1]]]  # "ends": a new sequence, same key
    returned = []
    for step, rows in enumerate(batches):
        if step == 4:
            guides.forget("ends")
        masks = guides.masks(rows)
        expected = [None if row is None else alone(guides, row[1], row[2]) for row in rows]
        assert [mask is None for mask in masks] == [row is None for row in rows]
        assert all(mask is None or torch.equal(mask, want) for mask, want in zip(masks, expected))
        returned.append((masks, [None if mask is None else mask.clone() for mask in masks]))
    assert all(mask is None or torch.equal(mask, kept)
               for masks, clones in returned for mask, kept in zip(masks, clones))
    assert len({tuple(mask.nonzero().flatten().tolist()) for mask in returned[0][1][1:4]}) == 3  # (they part ways)


def test_masks_held_unread_past_the_next_call_keep_their_own_rows(monkeypatch):
    """A call's masks read the guides' bitmask in place (packed, `words` at `address`); the next call writes that
    bitmask again, so masks still held then take a copy of their rows first: read afterwards, packed or unpacked,
    they are their own batch's, never the next one's; masks no longer held cost the next call no copy."""
    from kvcentric.engine.model.guided import BatchMasks

    copies = []
    detach = BatchMasks.detach
    monkeypatch.setattr(BatchMasks, "detach", lambda masks: (copies.append(masks.rows), detach(masks))[1])
    guides = Guides(PRESETS["tiny"])
    choice = parse_guide({"guided_choice": ["alpha", "beta"]})
    regex = parse_guide({"guided_regex": r"[0-9]{3}"})
    first_rows = [("a", choice, list(b"al")), None, ("b", regex, list(b"1"))]
    first = guides.masks(first_rows)
    assert first.words is not None and first.address == guides._address  # in place: no copy made
    packed = first.words.copy()
    second = guides.masks([("c", regex, []), ("d", choice, [])])
    assert second.address == guides._address and first.address != guides._address  # first copied out
    assert np.array_equal(first.words, packed) and not np.array_equal(second.words, packed[:2])
    for mask, row in zip(first, first_rows):
        assert (mask is None) == (row is None)
        assert row is None or torch.equal(mask, alone(guides, row[1], row[2]))
    assert copies == [[0, 2]]
    del first, second
    third = guides.masks([("e", regex, list(b"12"))])
    assert copies == [[0, 2]] and third.address == guides._address  # nothing held the second's: no copy


def test_a_decode_batch_that_grows_and_shrinks_samples_each_row_as_it_would_alone():
    """`BatchSampler.choose_all` step after step, the batch changing (rows ending, new ones joining, n sequences of
    one request, a row asking for logprobs, a plain row): each row's token is the one `choose` picks for it alone."""
    from factories import decode_job, make_pool, make_runner
    from kvcentric.engine.cores.decode import DecodeEngine
    from kvcentric.engine.cores.sequence import DecodeRequest

    schema = parse_guide({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}})
    choice = parse_guide({"guided_choice": ["alpha", "beta"]})
    seeded = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=3, guide=schema)
    kinds = {"a": (seeded, 0), "a#1": (seeded, 1), "a#2": (seeded, 2),
             "b": (SamplingParams(max_tokens=40, temperature=0.0, guide=choice), 0),
             "c": (SamplingParams(max_tokens=40, temperature=0.5, seed=1, logprobs=1, guide=schema), 0),
             "d": (SamplingParams(max_tokens=40, temperature=1.0, seed=2), 0)}
    runner = make_runner()
    together, alone_ = DecodeEngine(runner, make_pool(runner)), DecodeEngine(runner, make_pool(runner))
    torch_masks = DecodeEngine(runner, make_pool(runner))
    torch_masks.sampler.cpu_masks = None
    assert (together.sampler.cpu_masks is not None) == (runner.kernels is not None)
    generated: dict[str, list[int]] = {key: [] for key in kinds}
    for step, keys in enumerate([["a", "a#1", "a#2", "b", "d"], ["a#1", "c"], ["c", "a", "a#2", "a#1", "b", "d"],
                                 ["b"], ["d", "a#2", "a"], ["a", "a#1", "a#2", "b", "c", "d"]]):
        logits = torch.randn(len(keys), runner.config.vocab_size, generator=torch.Generator().manual_seed(step))
        batch = [DecodeRequest(decode_job(key.split("#")[0], 3, kinds[key][0]), deadline=0.0, prompt=[256, 1, 2],
                               generated=list(generated[key]), index=kinds[key][1]) for key in keys]
        expected = [alone_.sampler.choose(logits[row], request) for row, request in enumerate(batch)]
        assert together.sampler.choose_all(logits.clone(), batch) == expected  # the masks applied by the C++ op
        assert torch_masks.sampler.choose_all(logits, batch) == expected  # and by torch's
        for key, token in zip(keys, expected):
            generated[key] = [] if token in runner.config.eos_token_ids else generated[key] + [token]


def test_a_sequence_whose_shared_lexer_runs_out_of_states_goes_on_on_a_matcher_of_its_own():
    """Copies of a prototype share its lexer and its bound on states: a copy that reaches the bound is replayed on
    a matcher of its own, so its masks are those it gets alone, never an end forced by the others' states."""
    guides = Guides(PRESETS["tiny"])
    grammar = LLMatcher.grammar_from_regex(r"(a|b)*a(a|b){12}")  # a lexer of thousands of states
    guides.prototypes[grammar] = (LLMatcher(guides.tokenizer, grammar, limits=LLParserLimits(max_lexer_states=300)), 0)
    generator = np.random.default_rng(0)
    outputs = [[int(t) for t in generator.choice([ord("a"), ord("b")], 30)] for _ in range(6)]
    for end in range(31):
        masks = guides.masks([(f"r{i}", grammar, output[:end]) for i, output in enumerate(outputs)])
        for mask, output in zip(masks, outputs):
            assert mask is not None and torch.equal(mask, alone(guides, grammar, output[:end]))
            assert bool(mask[ord("a")]) and bool(mask[ord("b")])
    assert not any(matcher.is_error() for matcher, _, _ in guides.matchers.values())
    assert not all(shared for _, _, shared in guides.matchers.values())  # some went on on their own


def test_a_decode_batch_samples_under_masks_computed_together_as_row_by_row():
    """`BatchSampler.choose_all` with the masks `start` began (a decode step's path) picks what `choose` picks
    for each guided row alone, greedy and seeded, beside plain rows."""
    from factories import decode_job, make_pool, make_runner
    from kvcentric.engine.cores.decode import DecodeEngine
    from kvcentric.engine.cores.sequence import DecodeRequest

    schema = parse_guide({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}})
    choice = parse_guide({"guided_choice": ["alpha", "beta"]})
    kinds = [(SamplingParams(max_tokens=40, temperature=0.0, guide=schema), b'{"ok":'),
             (SamplingParams(max_tokens=40, temperature=0.0), b""),
             (SamplingParams(max_tokens=40, temperature=1.0, seed=5, guide=schema), b'{"ok":true,"size":"'),
             (SamplingParams(max_tokens=40, temperature=0.7, seed=2, guide=choice), b"al"),
             (SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, guide=choice), b"")]
    runner = make_runner()
    for seed in range(4):
        logits = torch.randn(len(kinds), runner.config.vocab_size, generator=torch.Generator().manual_seed(seed))
        together, alone_ = DecodeEngine(runner, make_pool(runner)), DecodeEngine(runner, make_pool(runner))
        batch = [DecodeRequest(decode_job(f"r{i}", 3, params), deadline=0.0, prompt=[256, 1, 2],
                               generated=list(output)) for i, (params, output) in enumerate(kinds)]
        expected = [alone_.sampler.choose(logits[row], request) for row, request in enumerate(batch)]
        assert together.sampler.start(batch) is None  # on the CPU: computed in choose_all, after the forward
        assert together.sampler.choose_all(logits, batch) == expected
        together.guides.overlap = True  # as off the CPU: begun on the worker thread, during the forward
        assert together.sampler.choose_all(logits, batch, together.sampler.start(batch)) == expected


@pytest.mark.parametrize("mixed", [False, True])
def test_guided_tokens_through_the_colocated_engine_are_the_same_with_masks_overlapping_the_forward(mixed):
    """Several guided requests at once (greedy and seeded, n = 3, a plain one among them) through the colocated
    engine's split or mixed steps: the same tokens with the masks computed after the forward (the CPU's way) and
    during it on the worker thread (the way off the CPU), and every matcher dropped at the end."""
    import collections

    from factories import make_pool, make_runner, prefill_job, prompt
    from kvcentric.core.hashing import BlockHasher
    from kvcentric.core.protocol import DecodeJob
    from kvcentric.engine.cores.colocated import ColocatedEngine
    from kvcentric.engine.cores.mixed import MixedStepper

    guides = [parse_guide({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}),
              parse_guide({"guided_choice": ["alpha", "beta", "gamma delta"]}),
              parse_guide({"guided_regex": r"[a-z]{2,5}-[0-9]{3}"})]
    answers = []
    for overlap in (False, True):
        runner = make_runner(num_blocks=256, block_size=4)
        engine = ColocatedEngine(runner, make_pool(runner), BlockHasher(block_size=4))
        engine.decode.guides.overlap = overlap
        stepper = MixedStepper(engine, 64) if mixed else None
        expected = 0
        for i in range(7):
            params = (SamplingParams(max_tokens=30, temperature=0.0) if i == 6 else
                      SamplingParams(max_tokens=30, temperature=0.0, guide=guides[i % 3]) if i < 3 else
                      SamplingParams(max_tokens=30, temperature=1.0, seed=i, n=3, guide=guides[i % 3]))
            job = prefill_job(prompt(9 + i, i), params, request_id=f"q{i}")
            engine.submit(job, DecodeJob(request_id=job.request_id, n_prompt_tokens=len(job.token_ids),
                                         sampling=params))
            expected += params.n
        tokens: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
        done = set()
        while len(done) < expected:
            for chunk in (stepper.step() if stepper is not None else engine.step()):
                tokens[(chunk.request_id, chunk.index)] += chunk.token_ids
                if chunk.finish_reason is not None:
                    done.add((chunk.request_id, chunk.index))
        assert not engine.decode.guides.matchers and not engine.prefill.guides.matchers
        answers.append(dict(tokens))
    assert answers[0] == answers[1]
    assert ByteTokenizer().decode([t for t in answers[0][("q1", 0)] if t < 256]) in ("alpha", "beta", "gamma delta")


@pytest.mark.parametrize("vocab", [258, 32000])
def test_a_mask_that_allows_one_token_names_it_and_the_row_takes_it_without_a_draw(vocab):
    """A row whose mask allows one token alone (a literal of its grammar) is named in `BatchMasks.forced`, on every
    bit of the bitmask's words (bit 31, the sign of an int32, included), and `choose_all` gives it the token that
    every draw under the mask gives; a row that asks for logprobs, or whose min_tokens still holds back EOS, is
    sampled as before."""
    from factories import decode_job, make_pool, make_runner
    from kvcentric.engine.cores.decode import DecodeEngine
    from kvcentric.engine.cores.sequence import DecodeRequest

    guides = Guides(dataclasses.replace(PRESETS["tiny"], vocab_size=vocab))
    for character in "?a~":  # 63: bit 31 of word 1
        grammar = parse_guide({"guided_regex": re.escape(character) + "x"})
        masks = guides.masks([None, (f"k{character}", grammar, [])])
        assert masks.forced == {1: ord(character)}
        assert guides.masks([(f"k{character}", grammar, [ord(character), ord("x")])]).forced == {0: 257}  # EOS alone
    choice = parse_guide({"guided_choice": ["alpha", "beta"]})
    runner = make_runner()
    engine, alone_ = DecodeEngine(runner, make_pool(runner)), DecodeEngine(runner, make_pool(runner))
    for seed in range(8):
        kinds = [SamplingParams(max_tokens=40, temperature=1.0, seed=seed, guide=choice),
                 SamplingParams(max_tokens=40, temperature=1.0, seed=seed, logprobs=1, guide=choice),
                 SamplingParams(max_tokens=40, temperature=0.0, guide=choice),
                 SamplingParams(max_tokens=40, temperature=1.0, seed=seed)]
        batch = [DecodeRequest(decode_job(f"r{seed}.{i}", 3, params), deadline=0.0, prompt=[256, 1, 2],
                               generated=list(b"al")) for i, params in enumerate(kinds)]
        logits = torch.randn(len(batch), runner.config.vocab_size, generator=torch.Generator().manual_seed(seed)) * 4
        expected = [alone_.sampler.choose(logits[row], request) for row, request in enumerate(batch)]
        assert expected[:3] == [ord("p")] * 3
        assert engine.sampler.choose_all(logits, batch) == expected
        assert batch[0].next_logprob is None and batch[1].next_logprob is not None  # the logprobs row was sampled
    held = DecodeRequest(decode_job("held", 3, SamplingParams(max_tokens=40, temperature=1.0, seed=1, min_tokens=9,
                                                              guide=parse_guide({"guided_regex": "ab"}))),
                         deadline=0.0, prompt=[256, 1, 2], generated=list(b"ab"))
    assert not takes_forced(held)  # EOS is the only token allowed, and min_tokens holds it back: `choose` decides
