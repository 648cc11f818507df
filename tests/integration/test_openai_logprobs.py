"""Logprobs, echo, penalties and strict parameters through the official `openai` client, against a locally
built Llama checkpoint served disaggregated (prefill + decode) and colocated: every logprob equals the one
transformers computes on the same checkpoint."""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch

from checkpoints import build_checkpoint, hf_model
from harness import UpProcess
from kvcentric.model.tokenizer import load_tokenizer
from waiting import eventually

PROMPT = "Mooncake schedules requests by prefix cache hits"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt-logprobs"), "llama")


@pytest.fixture(scope="module")
def reference(checkpoint):
    model, tokenizer = hf_model(checkpoint), load_tokenizer(str(checkpoint))

    def logprobs(ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] log-probabilities of the token after each position, as transformers has them."""
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs, tokenizer


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def client(request, checkpoint, tmp_path_factory):
    flags = ("--colocated", "1") if request.param == "colocated" else ()
    up = UpProcess(str(tmp_path_factory.mktemp(f"up-{request.param}")), "--model", str(checkpoint), *flags)
    try:
        with openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            client.served_model = client.models.list().data[0].id
            client.stats = lambda: {**up.health("colocated-0" if flags else "prefill-0")["stats"],
                                    **up.health("colocated-0" if flags else "decode-0")["stats"]}
            yield client
    finally:
        up.stop()


def greedy(logprobs_of, ids: list[int], count: int) -> list[int]:
    out: list[int] = []
    for _ in range(count):
        out.append(int(logprobs_of(ids + out)[-1].argmax()))
    return out


def complete(client, **body):
    return client.completions.create(model=client.served_model, **body)


def test_completion_logprobs_are_the_models_and_streaming_gives_the_same(client, reference):
    logprobs_of, tokenizer = reference
    answer = complete(client, prompt=PROMPT, max_tokens=6, logprobs=3, **GREEDY)
    got = answer.choices[0].logprobs
    prompt_ids = tokenizer.encode(PROMPT)
    generated = greedy(logprobs_of, prompt_ids, 6)
    expected = logprobs_of(prompt_ids + generated)
    assert got.tokens == [tokenizer.decode([token]) for token in generated]
    assert len(got.token_logprobs) == answer.usage.completion_tokens == 6
    for step, (value, top) in enumerate(zip(got.token_logprobs, got.top_logprobs)):
        row = expected[len(prompt_ids) - 1 + step]
        assert value == pytest.approx(float(row[generated[step]]), abs=1e-3)
        assert 1 <= len(top) <= 3  # keyed by text: tokens that read the same (partial UTF-8) share a key
        assert max(top.values()) == pytest.approx(value, abs=1e-6)  # greedy: the likeliest
        likeliest = row.topk(3).values.tolist()
        assert all(any(abs(v - w) < 1e-3 for w in likeliest) for v in top.values())
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(6)]
    chunks = list(complete(client, prompt=PROMPT, max_tokens=6, logprobs=3, stream=True, **GREEDY))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(got.token_logprobs, abs=1e-6)


def test_echo_scores_the_prompt_as_transformers_does_even_with_max_tokens_zero(client, reference):
    logprobs_of, tokenizer = reference
    ids = tokenizer.encode(PROMPT)
    expected = logprobs_of(ids)
    for max_tokens in (0, 1):
        answer = complete(client, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0)
        got = answer.choices[0].logprobs
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        scored = got.token_logprobs[1:len(ids)]
        assert scored == pytest.approx([float(expected[i - 1, ids[i]]) for i in range(1, len(ids))], abs=1e-3)
        assert len(got.tokens) == len(ids) + max_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
        assert answer.choices[0].text.startswith(tokenizer.decode(ids))
    assert answer.choices[0].finish_reason == "length"


def test_return_token_ids_are_the_greedy_tokens_whole_or_streamed(client, reference):
    """vLLM's `return_token_ids`: the completion's ids are transformers' greedy ones, the prompt's come back as
    given, and a stream's events carry each its own ids (the prompt's in the first)."""
    logprobs_of, tokenizer = reference
    ids = tokenizer.encode(PROMPT)
    expected = greedy(logprobs_of, ids, 8)
    with_ids = {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    whole = complete(client, prompt=ids, max_tokens=8, **with_ids).choices[0]
    assert whole.token_ids == expected and whole.prompt_token_ids == ids
    chunks = [c for c in complete(client, prompt=ids, max_tokens=8, stream=True, **with_ids) if c.choices]
    assert [t for c in chunks for t in c.choices[0].token_ids] == expected
    assert chunks[0].choices[0].prompt_token_ids == ids
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in chunks[1:])

    messages = [{"role": "user", "content": PROMPT}]
    answer = client.chat.completions.create(model=client.served_model, messages=messages, max_tokens=5, **with_ids)
    assert len(answer.prompt_token_ids) == answer.usage.prompt_tokens
    assert len(answer.choices[0].token_ids) == answer.usage.completion_tokens == 5
    events = list(client.chat.completions.create(model=client.served_model, messages=messages, max_tokens=5,
                                                 stream=True, **with_ids))
    assert events[0].prompt_token_ids == answer.prompt_token_ids
    assert [t for e in events for t in (getattr(e.choices[0], "token_ids", None) or [])] == answer.choices[0].token_ids
    assert "token_ids" not in complete(client, prompt=ids, max_tokens=2, **GREEDY).choices[0].model_extra
    sampled = complete(client, prompt=ids, max_tokens=4, n=2, best_of=3, temperature=0.8, seed=1,
                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [len(choice.token_ids) for choice in sampled.choices] == [4, 4]  # the two likeliest of three
    assert all(choice.prompt_token_ids == ids for choice in sampled.choices)
    assert [tokenizer.decode(choice.token_ids) for choice in sampled.choices] == [c.text for c in sampled.choices]


def test_chat_logprobs_streamed_and_not(client, reference):
    messages = [{"role": "user", "content": "Name a cache."}]
    whole = client.chat.completions.create(model=client.served_model, messages=messages, max_tokens=4,
                                           logprobs=True, top_logprobs=2, **GREEDY)
    content = whole.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == whole.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    assert all(bytes(t.bytes).decode() == t.token for t in content)
    chunks = list(client.chat.completions.create(model=client.served_model, messages=messages, max_tokens=4,
                                                 logprobs=True, top_logprobs=2, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    streamed = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([t.logprob for t in content], abs=1e-6)
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def test_processed_logprobs_follow_temperature_and_bias(client, reference):
    logprobs_of, tokenizer = reference
    ids = tokenizer.encode(PROMPT)
    row = logprobs_of(ids)[-1]
    target = int(row.argmin())
    answer = complete(client, prompt=ids, max_tokens=1, logprobs=0, temperature=0,
                      logit_bias={str(target): 100}, extra_body={"logprobs_mode": "processed_logprobs"})
    assert answer.choices[0].logprobs.tokens == [tokenizer.decode([target])]
    assert answer.choices[0].logprobs.token_logprobs[0] == pytest.approx(0.0, abs=1e-3)
    raw = complete(client, prompt=ids, max_tokens=1, logprobs=0, temperature=0, logit_bias={str(target): 100})
    assert raw.choices[0].logprobs.token_logprobs[0] == pytest.approx(float(row[target]), abs=1e-3)


def generated_ids(client, **body) -> list[int]:
    answer = complete(client, prompt=PROMPT, max_tokens=12, logprobs=0, **body)
    return answer.choices[0].logprobs.tokens


def test_penalties_change_the_output_and_are_deterministic_with_a_seed(client):
    plain = generated_ids(client, **GREEDY)
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                    {"extra_body": {"repetition_penalty": 2.0, "ignore_eos": True}}):
        body = {**GREEDY, **penalty}
        penalised = generated_ids(client, **body)
        assert penalised != plain and penalised == generated_ids(client, **body)
        assert len(set(penalised)) >= len(set(plain))
    seeded = {"temperature": 1.0, "seed": 7, "frequency_penalty": 1.0, "extra_body": {"ignore_eos": True}}
    assert generated_ids(client, **seeded) == generated_ids(client, **seeded)


def test_min_tokens_holds_eos_back(client, reference):
    logprobs_of, tokenizer = reference
    eos = 2
    stops = complete(client, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={str(eos): 100})
    assert stops.usage.completion_tokens == 1 and stops.choices[0].finish_reason == "stop"
    held = complete(client, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias={str(eos): 100},
                    extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("field, value", [("suffix", "x"), ("tools", [{"type": "function"}]),
                                          ("response_format", {"type": "yaml"}), ("best_of", 17),
                                          ("n", 0), ("frequency_penalty", 3), ("logit_bias", {"-1": 1})])
def test_unsupported_or_out_of_range_parameters_are_a_400_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, prompt=PROMPT, max_tokens=1, extra_body={field: value})
    assert caught.value.body["param"] == field


def test_a_required_tool_call_and_a_json_schema_hold_with_the_checkpoints_tokenizer(client):
    """The grammar's mask over a checkpoint's own vocabulary (its tokenizer.json), the tools shown by its chat
    template: a random model at temperature 1 still writes one call of the function, and JSON the schema takes."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"], "additionalProperties": False}}}
    answer = client.chat.completions.create(model=client.served_model, messages=[{"role": "user", "content": "x"}],
                                            tools=[tool], tool_choice="required", parallel_tool_calls=False,
                                            temperature=1.0, seed=2, max_tokens=60)
    (call,) = answer.choices[0].message.tool_calls or []
    assert call.function.name == "f" and isinstance(json.loads(call.function.arguments)["x"], bool)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    text = complete(client, prompt=PROMPT, max_tokens=40, temperature=1.0, seed=4,
                    extra_body={"structured_outputs": {"json": schema}}).choices[0].text
    assert 0 <= json.loads(text)["n"] <= 9


def test_logprobs_of_a_sampled_token_are_finite_and_ranked(client):
    answer = complete(client, prompt=PROMPT, max_tokens=8, logprobs=5, temperature=1.5, seed=3)
    got = answer.choices[0].logprobs
    assert all(math.isfinite(v) and v <= 0 for v in got.token_logprobs)
    assert all(1 <= len(top) <= 6 for top in got.top_logprobs)  # 5 and the chosen one, keyed by text


SEEDED = {"temperature": 1.0, "seed": 5, "extra_body": {"ignore_eos": True}}


def test_n_choices_come_from_one_prefill_and_the_first_is_the_n1_answer(client):
    before = client.stats()
    answer = complete(client, prompt=PROMPT, max_tokens=6, n=3, logprobs=0, **SEEDED)
    after = client.stats()
    assert [c.index for c in answer.choices] == [0, 1, 2] and answer.usage.completion_tokens == 18
    assert after["requests_prefilled"] - before["requests_prefilled"] == 1
    assert after["sequences_forked"] - before["sequences_forked"] == 2
    assert len({c.text for c in answer.choices}) > 1
    single = complete(client, prompt=PROMPT, max_tokens=6, logprobs=0, **SEEDED)
    assert single.choices[0].text == answer.choices[0].text
    best = complete(client, prompt=PROMPT, max_tokens=6, best_of=3, **SEEDED)
    likeliest = max(answer.choices, key=lambda c: sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [likeliest.text] and best.choices[0].logprobs is None
    eventually(client.stats, "every KV block free after the forked sequences end",
               until=lambda stats: stats["kv_blocks_free"] == stats["kv_blocks_total"], every_s=0.1)


def test_n_choices_stream_by_index_as_the_whole_answer_has_them(client):
    messages = [{"role": "user", "content": "Name a cache."}]
    asked = dict(model=client.served_model, messages=messages, max_tokens=5, n=2, **SEEDED)
    whole = client.chat.completions.create(**asked)
    chunks = list(client.chat.completions.create(stream=True, **asked))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
