"""Function calling: tools and tool_choice checked (a 400 naming the field otherwise), `required` and a named
function enforced by the grammar (a random model at temperature 1 always writes a call that parses, of an
allowed function, with arguments its schema accepts), and tool calls found in whole and streamed answers."""

from __future__ import annotations

import json

import pytest
import torch

from kvcentric.core.openai_api import ApiError, parse_chat
from kvcentric.core.openai_tools import ToolCallStream, split_answer
from kvcentric.engine.model.guided import Guides
from kvcentric.engine.model.sampling import choose
from kvcentric.model.config import PRESETS
from kvcentric.model.tokenizer import ByteTokenizer, DummyTokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "properties": {"city": {"enum": ["Oslo", "Lima"]}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "weather?"}]


def chat(**body):
    return parse_chat({"messages": MESSAGES, **body}, "tiny", 2048)


def sample(guide: str, seed: int) -> str:
    guides, params = Guides(PRESETS["tiny"]), chat(tools=[WEATHER, TIME], tool_choice="required",
                                                   parallel_tool_calls=False, temperature=1.0, seed=seed).sampling
    assert params.guide == guide
    generator, output = torch.Generator().manual_seed(seed), []
    for step in range(300):
        token, _ = choose(torch.randn(258, generator=generator) * 4, params, step, [256], output, {257}, 0,
                          guides.mask("r", params, output))
        if token == 257:
            return ByteTokenizer().decode(output)
        output.append(token)
    raise AssertionError("no end")


def test_required_always_gives_one_parsable_call_of_a_declared_function():
    guide = chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).sampling.guide
    for seed in range(8):
        content, calls = split_answer(sample(guide, seed), {"get_weather", "get_time"})
        assert content is None and len(calls) == 1
        arguments = json.loads(calls[0]["function"]["arguments"])
        if calls[0]["function"]["name"] == "get_weather":
            assert arguments["city"] in ("Oslo", "Lima")
        else:
            assert -12 <= arguments["zone"] <= 14


def test_tool_choice_decides_the_grammar_and_what_the_template_shows():
    assert chat(tools=[WEATHER]).sampling.guide == ""  # auto: the model decides, the answer is parsed
    assert chat(tools=[WEATHER], tool_choice="none").tools.shown == []
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.sampling.guide and named.tools.choice == "get_time" and "get_weather" not in named.sampling.guide
    rendered = DummyTokenizer().apply_chat_template(MESSAGES, tools=chat(tools=[WEATHER]).tools.shown)
    assert rendered.startswith('tools: [{"type": "function", "function": {"name": "get_weather"')


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as caught:
        chat(**body)
    assert caught.value.status == 400 and caught.value.param == param


def test_tagged_calls_stream_out_as_they_close_and_the_rest_is_content():
    stream = ToolCallStream({"get_weather"})
    pieces = ["Let me check. <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>',
              " <tool_call>{\"name\": \"unknown\"}</tool_call> done <tool_c"]
    seen = [stream.feed(piece) for piece in pieces]
    assert [content for content, _ in seen] == ["Let me check. ", "", "",
                                                ' <tool_call>{"name": "unknown"}</tool_call> done ']
    assert [call["function"] for _, calls in seen for call in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert stream.finish() == "<tool_c"


def test_a_whole_answer_may_be_a_bare_json_call_or_a_list_of_them():
    names = {"get_weather", "get_time"}
    assert split_answer('{"name": "get_time", "parameters": {"zone": 1}}', names)[1][0]["function"] == {
        "name": "get_time", "arguments": '{"zone": 1}'}
    assert len(split_answer('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]',
                            names)[1]) == 2
    assert split_answer('{"name": "other", "arguments": {}}', names) == ('{"name": "other", "arguments": {}}', [])
    assert split_answer("plain text", names) == ("plain text", [])
