"""Chat rendering: the simple template of the dummy models writes a message's name, a tool message's call id,
an assistant's tool calls and the request's tools; a checkpoint's template gets the tools, and a template that
refuses the conversation raises ChatTemplateError (the gateway's 400), not a bare ValueError."""

from __future__ import annotations

import json

import pytest

from checkpoints import save_tokenizer
from kvcentric.model.tokenizer import ChatTemplateError, DummyTokenizer, HFTokenizer


def test_the_simple_template_writes_names_call_ids_tool_calls_and_tools():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    messages = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "",
                                                                   "tool_calls": [call]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    text = DummyTokenizer().apply_chat_template(messages, tools=tools)
    assert text == (f"tools: {json.dumps(tools)}\nuser (ann): hi\n"
                    'assistant: <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
                    "tool (c1): 42\nassistant: ")
    assert DummyTokenizer().apply_chat_template(messages[:1], add_generation_prompt=False) == "user (ann): hi\n"


def test_a_checkpoint_template_sees_the_tools_and_its_refusal_is_a_chat_template_error(tmp_path):
    save_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% if tools %}[{{ tools | length }} tools]{% endif %}{% for m in messages %}"
                               "{% if m['role'] == 'system' %}{{ raise_exception('no system here') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HFTokenizer(str(tmp_path))
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tools=tools) == "[1 tools]x"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    with pytest.raises(ChatTemplateError, match="no system here"):
        tokenizer.encode_chat([{"role": "system", "content": "x"}])
    config["chat_template"] = "{{ messages[5]['content'] }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError):
        HFTokenizer(str(tmp_path)).encode_chat([{"role": "user", "content": "x"}])
