"""Structured outputs through the official `openai` client against real clusters of the random `tiny` model
at temperature 1: under a JSON schema every answer is JSON the schema accepts (whole and streamed, n > 1,
chat and completions), a choice is one of the choices, a regex matches; on the shared disaggregated cluster
(the first token sampled on prefill, the rest on decode)."""

from __future__ import annotations

import json
import re

import openai
import pytest

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "size", "count"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "sized", "schema": SCHEMA, "strict": True}}


def accepted(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"ok", "size", "count"} and isinstance(value["ok"], bool) and value["size"] in "SML"
            and isinstance(value["count"], int) and 0 <= value["count"] <= 99)


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


def test_a_random_model_under_a_json_schema_always_answers_json_the_schema_accepts(client):
    for seed in range(3):
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON?"}],
                                                temperature=1.0, seed=seed, n=3, max_tokens=200,
                                                response_format=FORMAT)  # type: ignore[arg-type]
        assert [choice.finish_reason for choice in answer.choices] == ["stop"] * 3
        assert all(accepted(choice.message.content or "") for choice in answer.choices)
    chunks = list(client.completions.create(model="tiny", prompt="JSON, streamed", temperature=1.0, seed=7,
                                            max_tokens=200, stream=True,
                                            extra_body={"structured_outputs": {"json": SCHEMA}}))
    assert accepted("".join(chunk.choices[0].text for chunk in chunks if chunk.choices))


def test_choice_and_regex_hold_for_completions_and_batches(client):
    answer = client.completions.create(model="tiny", prompt=["pick one", "and another"], temperature=1.0, seed=3,
                                       n=2, max_tokens=20, extra_body={"guided_choice": ["yes", "no", "maybe so"]})
    assert len(answer.choices) == 4 and {c.text for c in answer.choices} <= {"yes", "no", "maybe so"}
    answer = client.completions.create(model="tiny", prompt="an id", temperature=1.0, seed=5, max_tokens=20,
                                       extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", answer.choices[0].text)


def test_what_cannot_be_enforced_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_schema",  # type: ignore[arg-type]
                                                        "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert caught.value.body["param"] == "response_format"
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                            response_format={"type": "text"})
    assert answer.usage.completion_tokens >= 1


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"],
    "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}


def test_tool_choice_required_always_returns_a_parsable_call(client):
    for seed in range(2):
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, CLOCK],
            tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed, n=2,
            max_tokens=200)  # type: ignore[arg-type]
        for choice in answer.choices:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (call,) = choice.message.tool_calls or []
            arguments = json.loads(call.function.arguments)
            assert call.type == "function" and call.id.startswith("call_")
            assert (call.function.name, list(arguments)) in (("get_weather", ["city"]), ("get_time", ["zone"]))


def test_a_named_function_streams_its_call_as_delta_tool_calls(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=[WEATHER, CLOCK], temperature=1.0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False, seed=4,
        max_tokens=200, stream=True))  # type: ignore[arg-type]
    calls = [call for chunk in chunks for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_time"
    assert -12 <= json.loads(calls[0].function.arguments)["zone"] <= 14
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
