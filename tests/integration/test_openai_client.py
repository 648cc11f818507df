"""The official `openai` Python client against a running `kvcentric up`: completions and chat, streaming
and not, stop strings, errors and the API key."""

from __future__ import annotations

import os

import openai
import pytest

from conftest import stop
from kvcentric.tools.processes import get_json
from kvcentric.model.tokenizer import DummyTokenizer
from harness import spawn_service as spawn
from waiting import eventually

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a cache."}]


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def wait_kv_free(cluster) -> dict:
    """Decode's KV pool once every request is gone (cancels are asynchronous)."""
    return eventually(lambda: cluster.health("decode-0")["stats"], "every KV block free on decode",
                      until=lambda stats: stats["kv_blocks_free"] == stats["kv_blocks_total"], every_s=0.1)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_completion_and_its_stream_give_the_same_text_and_usage(client):
    whole = client.completions.create(model="tiny", prompt="Hello, Mooncake", max_tokens=8, **GREEDY)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens == len("Hello, Mooncake") + 1
    chunks = list(client.completions.create(model="tiny", prompt="Hello, Mooncake", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])  # once per stream, on the trailing chunk


def test_token_id_prompts_work_through_the_client(client):
    answer = client.completions.create(model="tiny", prompt=[256, 72, 105], max_tokens=3, **GREEDY)
    assert answer.usage.prompt_tokens == 3 and answer.usage.completion_tokens == 3


def test_chat_uses_the_simple_template_and_streams_the_same_answer(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, **GREEDY)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(DummyTokenizer().encode_chat(MESSAGES))
    assert whole.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, stream=True,
                                                 **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # usage only with stream_options.include_usage, as OpenAI


def first_unique_pair(text: str) -> int:
    """An index k > 0 such that text[k:k+2] occurs first at k (a stop string that cuts there)."""
    for k in range(1, len(text) - 2):
        if text.find(text[k:k + 2]) == k:
            return k
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_cuts_the_output_and_frees_the_request_on_the_engines(client, cluster, stream):
    prompt = f"stop strings, stream={stream}"
    text = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, **GREEDY).choices[0].text
    k = first_unique_pair(text)
    asked = dict(model="tiny", prompt=prompt, max_tokens=1500, stop=["\x00never", text[k:k + 2]], **GREEDY)
    if stream:
        chunks = list(client.completions.create(stream=True, **asked))
        cut, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        answer = client.completions.create(**asked)
        cut, finish = answer.choices[0].text, answer.choices[0].finish_reason
    assert cut == text[:k] and finish == "stop"
    stats = wait_kv_free(cluster)  # the gateway cancelled the 1500-token generation
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_an_unknown_model_and_n_above_sixteen_are_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert caught.value.status_code == 400 and caught.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="'n' must be an integer in"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, n=17)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=1)


@pytest.fixture(scope="module")
def keyed_gateway(cluster):
    """A second gateway on the cluster's bus that wants an API key (KVC_API_KEY)."""
    os.environ["KVC_API_KEY"] = "sk-test-key"
    try:
        process, port = spawn("gateway", cluster.manifest["nats_url"])
    finally:
        del os.environ["KVC_API_KEY"]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process)


def test_with_an_api_key_a_missing_or_wrong_key_is_401_and_health_stays_open(keyed_gateway):
    for key in ("wrong", "unused"):
        with openai.OpenAI(base_url=keyed_gateway + "/v1", api_key=key, max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError) as caught:
                wrong.models.list()
            assert caught.value.code == "invalid_api_key"
    with openai.OpenAI(base_url=keyed_gateway + "/v1", api_key="sk-test-key", max_retries=0) as right:
        answer = right.completions.create(model="tiny", prompt="with a key", max_tokens=2, **GREEDY)
    assert answer.usage.completion_tokens == 2
    assert get_json(keyed_gateway + "/health")[0] == 200
    document = get_json(keyed_gateway + "/openapi.json")[1]  # the description says a key is needed
    assert document["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "bearer" in document["components"]["securitySchemes"]
