import pytest

from kvcentric.core.openai_api import ApiError, check_context, completion_body, parse_completion


def parse(**body):
    return parse_completion(body, "tiny", 258)


def test_a_minimal_request_gets_openai_defaults():
    request = parse(prompt="hi")
    assert request.sampling.max_tokens == 16 and request.sampling.temperature == 1.0
    assert request.stream is False and request.prompt == "hi"


def test_token_id_prompts_and_a_batch_of_one_are_accepted():
    assert parse(prompt=[1, 2, 3]).prompt_token_ids == [1, 2, 3]
    assert parse(prompt=["hi"]).prompt == "hi"


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, 9999]}, "prompt"),
    ({"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "model": "gpt-4"}, "model"),
])
def test_bad_fields_are_400_naming_the_param(body, param):
    with pytest.raises(ApiError) as caught:
        parse(**body)
    assert caught.value.status == 400 and caught.value.param == param
    error = caught.value.body()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_a_body_that_is_not_an_object_is_rejected():
    with pytest.raises(ApiError):
        parse_completion([1, 2], "tiny", 258)


def test_prompt_plus_completion_beyond_the_context_is_rejected():
    check_context(100, 16, 2048)
    with pytest.raises(ApiError, match="maximum context length is 2048"):
        check_context(2040, 16, 2048)


def test_completion_body_has_the_openai_shape():
    body = completion_body("cmpl-1", "tiny", "abc", "length", {"prompt_tokens": 1})
    assert body["object"] == "text_completion"
    assert body["choices"][0] == {"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}


# ---------------------------------------------------------------- chat, stop, user


from kvcentric.core.openai_api import chat_body, chat_chunk, parse_chat, usage  # noqa: E402


def chat(**body):
    return parse_chat(body, ("tiny", "/models/tiny"), 2048)


def test_chat_messages_become_role_and_text_with_content_parts_joined():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request = chat(messages=[{"role": "system", "content": "be brief"},
                             {"role": "user", "content": parts},
                             {"role": "assistant", "content": None}])
    assert request.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                                {"role": "assistant", "content": ""}]
    assert request.max_tokens_defaulted and request.sampling.max_tokens == 2048


def test_chat_takes_max_completion_tokens_and_any_served_name():
    request = chat(model="/models/tiny", messages=[{"role": "user", "content": "x"}], max_completion_tokens=7)
    assert request.model == "tiny" and request.sampling.max_tokens == 7 and not request.max_tokens_defaulted


@pytest.mark.parametrize("messages", [None, [], ["hi"], [{"role": "wizard", "content": "x"}],
                                      [{"role": "user", "content": 3}],
                                      [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]])
def test_bad_chat_messages_are_400_naming_messages(messages):
    body = {} if messages is None else {"messages": messages}
    with pytest.raises(ApiError) as caught:
        chat(**body)
    assert caught.value.status == 400 and caught.value.param == "messages"


def test_stop_is_a_string_or_up_to_four_strings_and_user_is_kept():
    assert parse(prompt="x", stop="END").stop == ("END",)
    assert parse(prompt="x", stop=["a", "b"], user="u-1").user == "u-1"
    assert parse(prompt="x", stop=[]).stop == ()
    for bad in (["a", ""], ["a"] * 5, 3, [1]):
        with pytest.raises(ApiError) as caught:
            parse(prompt="x", stop=bad)
        assert caught.value.param == "stop"


def test_chat_shapes_and_cached_tokens_in_usage():
    body = chat_body("chatcmpl-1", "tiny", "hi", "stop", usage(3, 1))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    chunk = chat_chunk("chatcmpl-1", "tiny", {"content": "h"}, None, None, 1)
    assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk
    assert usage(32, 1, 16)["prompt_tokens_details"] == {"cached_tokens": 16}


def test_top_k_is_accepted_as_vllm_does():
    assert parse(prompt="x", top_k=5).sampling.top_k == 5
    assert parse(prompt="x", top_k=-1).sampling.top_k == 0
    with pytest.raises(ApiError):
        parse(prompt="x", top_k="five")


def test_priority_is_vllms_extension_validated():
    assert chat(messages=[{"role": "user", "content": "x"}]).priority == 0
    assert chat(messages=[{"role": "user", "content": "x"}], priority=3).priority == 3
    for bad in ("high", 1.5, True, 5000):
        with pytest.raises(ApiError) as raised:
            chat(messages=[{"role": "user", "content": "x"}], priority=bad)
        assert raised.value.status == 400 and raised.value.body()["error"]["param"] == "priority"


# ---------------------------------------------------------------- logprobs, echo, penalties, strict fields


def test_completion_logprobs_with_echo_ask_for_prompt_logprobs_and_allow_max_tokens_zero():
    request = parse(prompt="x", logprobs=2, echo=True, max_tokens=0)
    assert request.sampling.logprobs == request.sampling.prompt_logprobs == 2
    assert request.echo and request.discard_output and request.sampling.max_tokens == 1
    assert parse(prompt="x", logprobs=0).sampling.prompt_logprobs is None
    with pytest.raises(ApiError, match="0 only with echo"):
        parse(prompt="x", max_tokens=0)


def test_chat_logprobs_take_top_logprobs_only_with_logprobs_true():
    message = [{"role": "user", "content": "x"}]
    assert chat(messages=message, logprobs=True, top_logprobs=3).sampling.logprobs == 3
    assert chat(messages=message, logprobs=True).sampling.logprobs == 0
    assert chat(messages=message, logprobs=False).sampling.logprobs is None
    with pytest.raises(ApiError) as caught:
        chat(messages=message, top_logprobs=3)
    assert caught.value.param == "top_logprobs"


def test_return_token_ids_is_taken_by_both_endpoints():
    assert parse(prompt="x", return_token_ids=True).return_token_ids
    assert not parse(prompt="x").return_token_ids
    assert chat(messages=[{"role": "user", "content": "x"}], return_token_ids=True).return_token_ids


def test_penalties_bias_and_min_tokens_reach_the_sampling_params():
    sampling = parse(prompt="x", presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2,
                     min_tokens=3, logit_bias={"7": -100, "8": 2.5}, logprobs_mode="processed_logprobs").sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1.0, 1.2)
    assert sampling.min_tokens == 3 and sampling.logit_bias == {7: -100.0, 8: 2.5} and sampling.processed_logprobs


@pytest.mark.parametrize("body, param", [
    ({"suffix": "s"}, "suffix"), ({"tools": []}, "tools"), ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"best_of": 17}, "best_of"), ({"n": 3, "best_of": 2}, "best_of"), ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"), ({"top_k": 2 ** 31}, "top_k"), ({"stream_options": {"include_usage": 1}},
                                                                         "stream_options"),
    ({"logit_bias": {"\u0663": 1}}, "logit_bias"), ({"logprobs_mode": ""}, "logprobs_mode"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 99}, "min_tokens"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"300": 1}}, "logit_bias"), ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logprobs_mode": "raw_logits"}, "logprobs_mode"), ({"priority": None}, "priority"), ({"echo": 1}, "echo"),
    ({"return_token_ids": "yes"}, "return_token_ids"),
])
def test_unsupported_and_out_of_range_fields_are_400_naming_them(body, param):
    with pytest.raises(ApiError) as caught:
        parse(prompt="x", **body)
    assert caught.value.status == 400 and caught.value.param == param


def test_null_optional_fields_are_absent_fields():
    request = parse(prompt="x", suffix=None, tools=None, logprobs=None, n=None, logit_bias=None)
    assert request.sampling.logprobs is None and request.sampling.logit_bias == {}


def test_n_and_best_of_sample_best_of_sequences_and_rank_them_by_logprobs():
    request = parse(prompt="x", n=2, best_of=4)
    assert request.n == 2 and request.sampling.n == 4 and request.sampling.logprobs == 0
    assert not request.show_logprobs
    assert parse(prompt="x", n=3).sampling.n == 3 and parse(prompt="x", n=3).sampling.logprobs is None
    with pytest.raises(ApiError, match="cannot be streamed"):
        parse(prompt="x", n=1, best_of=2, stream=True)


# ---------------------------------------------------------------- the defects of issue 45


@pytest.mark.parametrize("mode", [{}, [], 1, True])
def test_a_logprobs_mode_that_is_not_a_string_is_a_400_not_a_crash(mode):
    with pytest.raises(ApiError) as caught:
        parse(prompt="x", logprobs_mode=mode)
    assert caught.value.status == 400 and caught.value.param == "logprobs_mode"


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": "AAA", "max_completion_tokens": 4}, "max_tokens"),
    ({"max_tokens": 4, "max_completion_tokens": "AAA"}, "max_completion_tokens"),
    ({"max_tokens": -1, "max_completion_tokens": 4}, "max_tokens"),
])
def test_max_tokens_is_checked_even_beside_max_completion_tokens(body, param):
    with pytest.raises(ApiError) as caught:
        chat(messages=[{"role": "user", "content": "x"}], **body)
    assert caught.value.param == param
    both = chat(messages=[{"role": "user", "content": "x"}], max_tokens=9, max_completion_tokens=4)
    assert both.sampling.max_tokens == 4


def test_stream_options_need_stream_and_take_continuous_usage_stats():
    request = parse(prompt="x", stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert request.include_usage and request.continuous_usage
    only = parse(prompt="x", stream=True, stream_options={"continuous_usage_stats": True})
    assert only.continuous_usage and not only.include_usage
    assert not parse(prompt="x", stream=False, stream_options={}).include_usage  # an empty object asks nothing
    for bad in ({"include_usage": True}, {"continuous_usage_stats": False}):
        with pytest.raises(ApiError, match="only allowed with 'stream': true") as caught:
            parse(prompt="x", stream_options=bad)
        assert caught.value.param == "stream_options"
    for bad in ({"obfuscate": True}, {"continuous_usage_stats": "yes"}, ["include_usage"]):
        with pytest.raises(ApiError) as caught:
            parse(prompt="x", stream=True, stream_options=bad)
        assert caught.value.param == "stream_options"


def test_message_name_tool_calls_and_tool_call_id_reach_the_template():
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    request = chat(messages=[{"role": "user", "content": "hi", "name": "ann"},
                             {"role": "assistant", "tool_calls": [call]},
                             {"role": "tool", "content": "-3C", "tool_call_id": "call_1"}])
    assert request.messages == [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "-3C", "tool_call_id": "call_1"}]


@pytest.mark.parametrize("message", [
    {"role": "user"}, {"role": "system", "content": None}, {"role": "user", "content": "x", "name": 3},
    {"role": "user", "content": "x", "tool_calls": []}, {"role": "user", "content": "x", "tool_call_id": "c"},
    {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]},
    {"role": "assistant", "tool_calls": "f()"}, {"role": "user", "content": "x", "audio": {"id": "a"}},
])
def test_bad_message_fields_are_400_naming_messages(message):
    with pytest.raises(ApiError) as caught:
        chat(messages=[message])
    assert caught.value.status == 400 and caught.value.param == "messages"


def test_a_batch_of_prompts_is_split_one_request_per_prompt():
    request = parse(prompt=["a", "bc"], n=2)
    assert request.batch == ("a", "bc") and request.prompt == "a"
    assert [(r.prompt, r.prompt_token_ids, r.batch) for r in request.each_prompt()] == [("a", None, ()),
                                                                                       ("bc", None, ())]
    tokens = parse(prompt=[[1, 2], [3]])
    assert [r.prompt_token_ids for r in tokens.each_prompt()] == [[1, 2], [3]]
    assert parse(prompt=["one"]).batch == () and parse(prompt=["one"]).each_prompt()[0].prompt == "one"


@pytest.mark.parametrize("prompt", [[], [[]], ["a", ""], ["a", [1]], [[1], [300]], ["a"] * 257, [["a"]]])
def test_a_bad_batch_is_a_400_naming_prompt(prompt):
    with pytest.raises(ApiError) as caught:
        parse(prompt=prompt)
    assert caught.value.status == 400 and caught.value.param == "prompt"


def test_tokenize_takes_a_prompt_or_messages_with_tools_and_detokenize_takes_ids():
    from kvcentric.core.openai_api import parse_detokenize, parse_tokenize

    asked = parse_tokenize({"prompt": "hi", "add_special_tokens": False, "return_token_strs": True}, "tiny")
    assert (asked.prompt, asked.add_special_tokens, asked.return_token_strs) == ("hi", False, True)
    tool = {"type": "function", "function": {"name": "f"}}
    chat = parse_tokenize({"messages": [{"role": "user", "content": "x"}], "tools": [tool],
                           "add_generation_prompt": False}, "tiny")
    assert chat.tools == [tool] and not chat.add_generation_prompt and not chat.add_special_tokens
    for bad, param in (({"prompt": "x", "tools": [tool]}, "tools"), ({}, "prompt"), ({"prompt": "x", "n": 2}, "n"),
                       ({"prompt": "x", "model": "other"}, "model")):
        with pytest.raises(ApiError) as caught:
            parse_tokenize(bad, "tiny")
        assert caught.value.param == param
    assert parse_detokenize({"tokens": [72, 105]}, "tiny", 258) == [72, 105]
    with pytest.raises(ApiError):
        parse_detokenize({"tokens": [1.5]}, "tiny", 258)
