"""Through the official `openai` client against the shared `kvcentric up` cluster: batched prompts (one choice
per prompt and per n, in OpenAI's order), vLLM's /tokenize and /detokenize, `continuous_usage_stats`, the
message fields an application that calls tools sends back, and the defects issue 45 found (each a 400 or an
answer now, never a 500)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from kvcentric.model.tokenizer import DummyTokenizer

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPTS = ["Batched prompts, first", "second one", "and the third"]


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def alone(client, prompt, max_tokens: int = 5) -> str:
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, **GREEDY).choices[0].text


def test_a_batch_answers_each_prompt_at_its_index_as_if_alone(client):
    texts = [alone(client, prompt) for prompt in PROMPTS]
    answer = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=5, n=2, **GREEDY)
    assert [choice.index for choice in answer.choices] == list(range(6))
    assert [choice.text for choice in answer.choices] == [text for text in texts for _ in range(2)]
    tokenizer = DummyTokenizer()
    assert answer.usage.prompt_tokens == sum(len(tokenizer.encode(prompt)) for prompt in PROMPTS)
    assert answer.usage.completion_tokens == 30 and len({answer.id}) == 1


def test_a_batch_of_token_lists_streams_every_choice_once_with_one_usage_chunk(client):
    prompts = [[256, 72, 105], [256, 79, 107, 33]]
    chunks = list(client.completions.create(model="tiny", prompt=prompts, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {index: alone(client, prompt, max_tokens=4) for index, prompt in enumerate(prompts)}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == ["length", "length"] and len({c.id for c in chunks}) == 1
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].choices == [] and usage[0].usage.completion_tokens == 8
    assert usage[0].usage.prompt_tokens == 7


def test_a_bad_prompt_in_a_batch_is_a_400_and_nothing_runs(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=["fine", "x" * 5000], max_tokens=4)
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="either strings or lists"):
        client.completions.create(model="tiny", prompt=["fine", [1, 2]], max_tokens=4)  # type: ignore[list-item]


def test_tokenize_and_detokenize_agree_with_what_generation_counts(client, cluster):
    whole = client.completions.create(model="tiny", prompt="Tokenize me", max_tokens=1)
    status, tokens = post(cluster.url + "/tokenize", {"model": "tiny", "prompt": "Tokenize me",
                                                      "return_token_strs": True})
    assert status == 200 and tokens["count"] == whole.usage.prompt_tokens == len(tokens["tokens"])
    assert tokens["max_model_len"] == 2048 and "".join(tokens["token_strs"][1:]) == "Tokenize me"
    status, text = post(cluster.url + "/detokenize", {"model": "tiny", "tokens": tokens["tokens"]})
    assert status == 200 and text == {"prompt": "Tokenize me"}
    messages = [{"role": "user", "content": "count me", "name": "ann"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    status, tokens = post(cluster.url + "/tokenize", {"messages": messages})
    assert status == 200 and tokens["count"] == chat.usage.prompt_tokens and tokens["token_strs"] is None
    for bad in ({"prompt": "x", "messages": messages}, {"prompt": 3},
                {"messages": messages, "add_special_tokens": True}):
        assert post(cluster.url + "/tokenize", bad)[0] == 400
    assert post(cluster.url + "/detokenize", {"tokens": [99999]})[1]["error"]["param"] == "tokens"


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    chunks = list(client.completions.create(model="tiny", prompt="continuous", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            **GREEDY))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c.usage is not None for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_name_tool_calls_and_tool_call_id_are_rendered_not_dropped(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather?", "name": "ann"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "content": "-3C", "tool_call_id": "call_1"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    rendered = DummyTokenizer().apply_chat_template(
        [{"role": "user", "content": "Weather?", "name": "ann"},
         {"role": "assistant", "content": "",
          "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
         {"role": "tool", "content": "-3C", "tool_call_id": "call_1"}])
    assert rendered == ('user (ann): Weather?\nassistant: <tool_call>{"name": "weather", "arguments": {"city": '
                        '"Oslo"}}</tool_call>\ntool (call_1): -3C\nassistant: ')
    assert answer.usage.prompt_tokens == len(rendered.encode()) + 1


@pytest.mark.parametrize("extra, param", [
    ({"logprobs_mode": {}}, "logprobs_mode"),
    ({"max_tokens": "AAA", "max_completion_tokens": 2}, "max_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "audio": {"id": "a"}}]}, "messages"),
])
def test_the_defects_found_are_400s_naming_the_parameter(cluster, extra, param):
    status, body = post(cluster.url + "/v1/chat/completions",
                        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra})
    assert status == 400 and body["error"]["param"] == param


def test_a_repetition_penalty_near_zero_generates(client):
    answer = client.completions.create(model="tiny", prompt="penalised", max_tokens=4, temperature=1.0, seed=1,
                                       extra_body={"repetition_penalty": 5e-324, "ignore_eos": True})
    assert answer.usage.completion_tokens == 4
    messages = [{"role": "assistant"}, {"role": "user", "content": "x"}]  # an assistant's content may be absent
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage.completion_tokens == 1
