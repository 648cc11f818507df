"""Function calling as OpenAI's chat API has it: `tools`, `tool_choice`, `parallel_tool_calls` checked, the
grammar that makes `required` and a named function hold, and the tool calls found in what the model wrote.

Calls are written in the hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (what the
dummy models' template shows the model, and what Qwen2's and Hermes' templates teach); a whole answer that is
only a JSON call (or a list of them) of a declared function counts too. `ToolCallStream` finds the tagged calls
in a stream as the text comes, so they go out as `delta.tool_calls`; a bare JSON call is found in whole answers
only (streamed, it is content). Nothing here renders or samples.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any

from llguidance import LLMatcher

from kvcentric.core.api_error import check
from kvcentric.core.structured import JSON_OPTIONS, guarded

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function's name, as OpenAI allows it."""


@dataclasses.dataclass(frozen=True)
class Tools:
    """A request's tools and what it asks of them."""

    functions: tuple[dict, ...]
    """Each {"name", "description"?, "parameters"?}: OpenAI's `tools[].function`."""
    choice: str = "auto"
    """"none" (the model is not shown the tools, as vLLM by default), "auto", "required", or a function's name."""
    parallel: bool = True

    @property
    def shown(self) -> list[dict]:
        """The tools as the chat template is given them ([] with tool_choice none)."""
        return [] if self.choice == "none" else [{"type": "function", "function": f} for f in self.functions]

    @property
    def names(self) -> set[str]:
        return {function["name"] for function in self.functions}


def parse_tools(body: dict) -> Tools | None:
    """The body's tools (None when it declares none and asks nothing of them)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    check(parallel is None or isinstance(parallel, bool), "'parallel_tool_calls' must be a boolean",
          "parallel_tool_calls")
    if tools is None:
        check(choice in (None, "none"), "'tool_choice' needs 'tools'", "tool_choice")
        return None
    check(isinstance(tools, list) and 0 < len(tools) <= MAX_TOOLS,
          f"'tools' must be a list of 1 to {MAX_TOOLS} tools", "tools")
    functions = tuple(_function(tool, index) for index, tool in enumerate(tools))
    names = [f["name"] for f in functions]
    check(len(set(names)) == len(names), "'tools' names a function twice", "tools")
    return Tools(functions, _choice(choice, set(names)), True if parallel is None else parallel)


def _function(tool: Any, index: int) -> dict:
    function = tool.get("function") if isinstance(tool, dict) else None
    check(isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict),
          f"tools[{index}] must be {{type: 'function', function: {{name, ...}}}}", "tools")
    assert isinstance(function, dict)
    name = function.get("name")
    check(isinstance(name, str) and NAME.fullmatch(name) is not None,
          f"tools[{index}].function.name must be 1 to 64 letters, digits, _ or -", "tools")
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    check(not unknown, f"tools[{index}].function.{unknown[0] if unknown else ''} is not supported", "tools")
    check(function.get("description") is None or isinstance(function["description"], str),
          f"tools[{index}].function.description must be a string", "tools")
    check(function.get("parameters") is None or isinstance(function["parameters"], dict),
          f"tools[{index}].function.parameters must be a JSON schema object", "tools")
    check(function.get("strict") is None or isinstance(function["strict"], bool),
          f"tools[{index}].function.strict must be a boolean", "tools")
    return {key: function[key] for key in ("name", "description", "parameters") if function.get(key) is not None}


def _choice(choice: Any, names: set[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    check(isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str),
          "'tool_choice' must be none, auto, required or {type: 'function', function: {name}}", "tool_choice")
    check(name in names, f"'tool_choice' names '{name}', which is not among the tools", "tool_choice")
    return str(name)


def tool_grammar(tools: Tools) -> str:
    """The grammar of `required` or a named function: one tagged call (more with parallel_tool_calls) of the
    allowed functions, each with arguments its parameters' schema accepts ("" for none and auto)."""
    if tools.choice in ("none", "auto"):
        return ""
    allowed = [f for f in tools.functions if tools.choice in ("required", f["name"])]
    call = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": f["name"]},
                                      "arguments": f.get("parameters") or {"type": "object"}}} for f in allowed],
            "x-guidance": JSON_OPTIONS}
    repeat = "+" if tools.parallel else ""
    lark = f'start: call{repeat}\ncall: "{OPEN}" body "{CLOSE}"\nbody: %json {json.dumps(call)}'
    grammar = LLMatcher.grammar_from_lark(lark)
    error = guarded(lambda: LLMatcher.validate_grammar(grammar), "tools")
    check(not error, f"a tool's parameters cannot be enforced: {error}", "tools")
    return grammar


def call_of(text: str, names: set[str]) -> dict | None:
    """OpenAI's tool call for one JSON call ({"name", "arguments" or "parameters"}) of a declared function."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": value["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


class ToolCallStream:
    """Text in, content and tool calls out: tagged calls are taken out of the text as they close; text that
    may be the start of a tag is held until it is sure. A tagged call that is not a declared function's JSON
    call stays content, tags and all."""

    def __init__(self, names: set[str]) -> None:
        self.names, self.held, self.calls = names, "", 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content to send, tool calls completed) after `text`."""
        text = self.held + text
        content: list[str] = []
        calls: list[dict] = []
        while True:
            start = text.find(OPEN)
            if start < 0:
                keep = _partial(text, OPEN)
                content.append(text[:len(text) - keep])
                self.held = text[len(text) - keep:]
                return "".join(content), calls
            end = text.find(CLOSE, start)
            if end < 0:
                content.append(text[:start])
                self.held = text[start:]
                return "".join(content), calls
            call = call_of(text[start + len(OPEN):end].strip(), self.names)
            content.append(text[:start] if call else text[:end + len(CLOSE)])
            if call:
                calls.append(call)
            text = text[end + len(CLOSE):]

    def finish(self) -> str:
        """What is held when the answer ends (an unclosed tag is content)."""
        held, self.held = self.held, ""
        return held


def split_answer(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """A whole answer's content (None when it was only calls) and its tool calls: tagged calls, else the
    whole answer as a JSON call or a list of them."""
    stream = ToolCallStream(names)
    content, calls = stream.feed(text)
    content += stream.finish()
    if not calls:
        bare = _bare_calls(text.strip(), names)
        if bare:
            return None, bare
    return (content if content.strip() or not calls else None), calls


def _bare_calls(text: str, names: set[str]) -> list[dict]:
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError:
            return []
        calls = [call_of(json.dumps(item), names) for item in items] if isinstance(items, list) else []
        return calls if calls and all(calls) else []  # type: ignore[return-value]
    call = call_of(text, names) if text.startswith("{") else None
    return [call] if call else []


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of `text` that `tag` starts with."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
