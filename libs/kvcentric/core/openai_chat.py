"""Chat messages as OpenAI's API sends them, checked and put in the form chat templates read.

`parse_messages` validates `messages` (role, content, and the `name`, `tool_calls` and `tool_call_id` an
application that calls tools sends back) and returns plain dicts: content as text, an assistant's tool
calls with their arguments as an object where they are JSON (as Hugging Face chat templates expect, and as
vLLM passes them). It renders nothing and knows no tokenizer; `kvcentric.model.tokenizer` renders.
"""

from __future__ import annotations

import json
from typing import Any

from kvcentric.core.api_error import ApiError, check

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
"""What a message may carry; any other field that is not null is a 400 naming it."""


def parse_messages(body: dict) -> list[dict]:
    """The body's `messages`, each {"role", "content"} plus `name`, `tool_calls`, `tool_call_id` when given."""
    check("messages" in body, "'messages' is a required property", "messages")
    messages = body["messages"]
    check(isinstance(messages, list) and len(messages) > 0, "'messages' must be a non-empty list", "messages")
    return [_message(message, index) for index, message in enumerate(messages)]


def _message(message: Any, index: int) -> dict:
    check(isinstance(message, dict), f"messages[{index}] must be an object", "messages")
    role = message.get("role")
    check(role in CHAT_ROLES, f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}", "messages")
    unknown = [key for key, value in message.items() if key not in MESSAGE_FIELDS and value is not None]
    check(not unknown, f"messages[{index}].{unknown[0] if unknown else ''} is not supported by this server",
          "messages")
    parsed = {"role": role, "content": _content(message, index)}
    name = message.get("name")
    if name is not None:
        check(isinstance(name, str) and name != "", f"messages[{index}].name must be a non-empty string",
              "messages")
        parsed["name"] = name
    if message.get("tool_calls") is not None:
        check(role == "assistant", f"messages[{index}].tool_calls: only an assistant message makes tool calls",
              "messages")
        parsed["tool_calls"] = _tool_calls(message["tool_calls"], index)
    if message.get("tool_call_id") is not None:
        check(role == "tool" and isinstance(message["tool_call_id"], str),
              f"messages[{index}].tool_call_id must be a string, on a tool message", "messages")
        parsed["tool_call_id"] = message["tool_call_id"]
    return parsed


def _content(message: dict, index: int) -> str:
    """A message's content as text: a string, or the text parts of a list of content parts. Only an
    assistant's may be absent (a turn that only called tools, or a prefill of the answer left empty)."""
    content = message.get("content")
    if content is None:
        check(message.get("role") == "assistant",
              f"messages[{index}].content is required for a {message.get('role')} message", "messages")
        return ""
    if isinstance(content, list):
        check(all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                  for p in content), f"messages[{index}].content: only text parts are supported", "messages")
        return "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{index}].content must be a string or a list of text parts", "messages")
    return content


def _tool_calls(calls: Any, index: int) -> list[dict]:
    """OpenAI's tool calls of an assistant message: [{id, type: function, function: {name, arguments}}]."""
    where = f"messages[{index}].tool_calls"
    check(isinstance(calls, list), f"{where} must be a list", "messages")
    parsed = []
    for number, call in enumerate(calls):
        function: Any = call.get("function") if isinstance(call, dict) else None
        check(isinstance(call, dict) and isinstance(call.get("id"), str) and call.get("type") == "function"
              and isinstance(function, dict) and isinstance(function.get("name"), str)
              and isinstance(function.get("arguments"), str),
              f"{where}[{number}] must be {{id, type: 'function', function: {{name, arguments}}}} with strings",
              "messages")
        parsed.append({"id": call["id"], "type": "function",
                       "function": {"name": function["name"], "arguments": _arguments(function["arguments"])}})
    return parsed


def _arguments(arguments: str) -> dict | str:
    """The arguments as an object when they are a JSON object (what templates write back out), else as sent."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
