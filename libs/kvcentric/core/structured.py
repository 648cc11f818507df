"""Structured outputs as the API asks for them, turned into one llguidance grammar the engines enforce.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and vLLM's `structured_outputs` (`json`,
`regex`, `choice`, `json_object`; and the older top-level `guided_json`, `guided_regex`, `guided_choice`)
become the grammar string of `SamplingParams.guide`, checked here so that a schema or regex llguidance cannot
compile is the client's 400, not an engine's failure. It masks nothing itself: `kvcentric.engine.model.guided` does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from llguidance import LLMatcher

from kvcentric.core.api_error import ApiError, check

JSON_OPTIONS = {"whitespace_flexible": False}
"""JSON without free whitespace between tokens: a model cannot spend its budget on blanks, so an object whose
values are bounded ends within a bounded number of tokens."""
REGEX_META = set("\\.+*?()|[]{}^$#&-~")
STRUCTURED_KEYS = ("json", "regex", "choice", "json_object")
LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}
FIELDS = frozenset({"response_format", "structured_outputs", *LEGACY})
"""The request fields that ask for structured output (at most one of them)."""


def parse_guide(body: dict) -> str:
    """The grammar the body asks its output to follow ("" for none); a 400 naming the field at fault."""
    asked = [name for name in sorted(FIELDS) if body.get(name) is not None]
    check(len(asked) <= 1, f"give one of {', '.join(sorted(FIELDS))}, not {' and '.join(asked)}",
          asked[-1] if asked else None)
    if not asked:
        return ""
    name = asked[0]
    if name == "response_format":
        grammar = _response_format(body[name])
    elif name == "structured_outputs":
        grammar = _structured_outputs(body[name])
    else:
        grammar = _one(LEGACY[name], body[name], name)
    if grammar:
        error = guarded(lambda: LLMatcher.validate_grammar(grammar), name)
        check(not error, f"'{name}' cannot be enforced: {error}", name)
    return grammar


def guarded(make: Callable[[], str], field: str) -> str:
    """What llguidance makes, its refusal a 400: an error it raises, or a panic of its Rust code (which
    reaches Python as a BaseException)."""
    try:
        return make()
    except Exception as exc:  # noqa: BLE001 - whatever it refuses is the client's input
        raise ApiError(400, f"'{field}' cannot be enforced: {exc}", field) from None
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise ApiError(400, f"'{field}' cannot be enforced: {exc}", field) from None


def _response_format(value: Any) -> str:
    """OpenAI's: {"type": "text"} (no constraint), {"type": "json_object"}, or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict", "description"}} (the schema enforced whether strict or not)."""
    kind = value.get("type") if isinstance(value, dict) else None
    check(kind in ("text", "json_object", "json_schema"),
          "'response_format.type' must be text, json_object or json_schema", "response_format")
    extra = sorted(set(value) - {"type", "json_schema"})
    check(not extra, f"'response_format.{extra[0] if extra else ''}' is not supported", "response_format")
    check(kind == "json_schema" or value.get("json_schema") is None,
          "'response_format.json_schema' goes with type json_schema", "response_format")
    if kind == "text":
        return ""
    if kind == "json_object":
        return _json({"type": "object"}, "response_format")
    spec = value.get("json_schema")
    check(isinstance(spec, dict) and isinstance(spec.get("name"), str),
          "'response_format.json_schema' must be an object with a 'name'", "response_format")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    check(not unknown, f"'response_format.json_schema.{unknown[0] if unknown else ''}' is not supported",
          "response_format")
    check(spec.get("strict") is None or isinstance(spec["strict"], bool),
          "'response_format.json_schema.strict' must be a boolean", "response_format")
    check(spec.get("description") is None or isinstance(spec["description"], str),
          "'response_format.json_schema.description' must be a string", "response_format")
    schema = spec.get("schema")
    schema = {"type": "object"} if schema is None else schema  # OpenAI: a missing schema is any object
    check(isinstance(schema, dict), "'response_format.json_schema.schema' must be an object", "response_format")
    return _json(schema, "response_format")


def _structured_outputs(value: Any) -> str:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, json_object."""
    check(isinstance(value, dict), "'structured_outputs' must be an object", "structured_outputs")
    unknown = sorted(key for key, item in value.items() if key not in STRUCTURED_KEYS and item is not None)
    check(not unknown, f"'structured_outputs.{unknown[0] if unknown else ''}' is not supported by this server "
                       f"(it takes {', '.join(STRUCTURED_KEYS)})", "structured_outputs")
    given = [key for key in STRUCTURED_KEYS if value.get(key) is not None and value.get(key) is not False]
    check(len(given) == 1, f"'structured_outputs' takes exactly one of {', '.join(STRUCTURED_KEYS)}",
          "structured_outputs")
    return _one(given[0], value[given[0]], "structured_outputs")


def _one(kind: str, value: Any, field: str) -> str:
    if kind == "json_object":
        check(value is True, f"'{field}.json_object' must be true", field)
        return _json({"type": "object"}, field)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ApiError(400, f"'{field}': the JSON schema is not valid JSON", field) from None
        check(isinstance(value, dict), f"'{field}': a JSON schema must be an object", field)
        return _json(value, field)
    if kind == "regex":
        check(isinstance(value, str) and value != "", f"'{field}': the regex must be a non-empty string", field)
        return guarded(lambda: LLMatcher.grammar_from_regex(value), field)
    check(isinstance(value, list) and len(value) > 0 and all(isinstance(c, str) and c for c in value),
          f"'{field}': the choice must be a non-empty list of non-empty strings", field)
    return guarded(lambda: LLMatcher.grammar_from_regex("|".join(_literal(choice) for choice in value)), field)


def _json(schema: dict, field: str) -> str:
    return guarded(lambda: LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS),  # type: ignore[arg-type]
                    field)


def _literal(text: str) -> str:
    """A regex matching `text` exactly (its metacharacters escaped)."""
    return "(" + "".join("\\" + c if c in REGEX_META else c for c in text) + ")"
