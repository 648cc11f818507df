"""The gateway's OpenAPI 3.1 description (GET /openapi.json): every endpoint, the request fields with the
types and bounds `kvcentric.core.openai_api` enforces, the answers' shapes and the errors.

What a schema cannot say (prompt plus max_tokens within the context, min_tokens at most max_tokens,
best_of at least n, logit_bias ids within the vocabulary, max_tokens 0 only with echo) the server checks
as well and answers with a 400; whatever the schema forbids, the server refuses.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcentric.core.openai_api import MAX_LOGIT_BIAS, MAX_PROMPTS, MAX_PRIORITY, MAX_TOP_K, SEED_MAX, SEED_MIN
from kvcentric.core.openai_chat import CHAT_ROLES
from kvcentric.core.openai_tools import MAX_TOOLS
from kvcentric.core.protocol import MAX_LOGPROBS, MAX_SEQUENCES


def nullable(schema: dict) -> dict:
    """The schema, or null (a null field is an absent one)."""
    return {"anyOf": [schema, {"type": "null"}]}


def integer(low: int, high: int | None = None, **extra) -> dict:
    bounds = {"minimum": low} if high is None else {"minimum": low, "maximum": high}
    return {"type": "integer", **bounds, **extra}


def number(low: float, high: float, **extra) -> dict:
    return {"type": "number", "minimum": low, "maximum": high, **extra}


def common_fields(served: Sequence[str], context: int, vocab: int) -> dict:
    """The fields both generation endpoints take."""
    return {
        "model": nullable({"type": "string", "enum": list(served)}),
        "max_completion_tokens": nullable(integer(1, context - 1)),
        "temperature": nullable(number(0, 2, description="0 (or below 1e-5) is greedy")),
        "top_p": nullable(number(1e-6, 1)),
        "n": nullable(integer(1, MAX_SEQUENCES, description="choices, sampled in parallel from one prefill")),
        "stream": {"type": "boolean"},
        "stream_options": nullable({"type": "object", "additionalProperties": {"type": "null"},
                                    "description": "only with stream: true (an empty object is no option)",
                                    "properties": {"include_usage": nullable({"type": "boolean"}),
                                                   "continuous_usage_stats": nullable({"type": "boolean"})}}),
        "stop": nullable({"anyOf": [{"type": "string", "minLength": 1},
                                    {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}}]}),
        "seed": nullable(integer(SEED_MIN, SEED_MAX)),
        "user": nullable({"type": "string"}),
        "presence_penalty": nullable(number(-2, 2)),
        "frequency_penalty": nullable(number(-2, 2)),
        "logit_bias": nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                "propertyNames": {"pattern": "^[0-9]{1,10}$"},
                                "additionalProperties": number(-100, 100),
                                "description": f"token id (< {vocab}) to a bias added to its logit"}),
        "ignore_eos": {"type": "boolean", "description": "vLLM extension: generate max_tokens"},
        "top_k": nullable(integer(-1, MAX_TOP_K, description="vLLM extension: the k likeliest only (0 or -1: all)")),
        "priority": integer(-MAX_PRIORITY, MAX_PRIORITY, description="vLLM extension, lower is more important"),
        "repetition_penalty": nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 2,
                                        "description": "vLLM extension"}),
        "min_tokens": nullable(integer(0, description="vLLM extension: at most max_tokens")),
        "logprobs_mode": nullable({"type": "string", "enum": ["raw_logprobs", "processed_logprobs"]}),
        "return_token_ids": {"type": "boolean", "description": "vLLM extension: the answer carries token_ids and "
                                                               "prompt_token_ids"},
        **structured_fields(),
    }


def structured_fields() -> dict:
    """Structured output (at most one of these; not with ignore_eos or min_tokens): OpenAI's response_format
    and vLLM's structured_outputs and guided_* fields."""
    schema = {"type": "object", "description": "a JSON schema"}
    regex = {"type": "string", "minLength": 1}
    choice = {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
    json_schema = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string"}, "schema": nullable(schema), "strict": nullable({"type": "boolean"}),
        "description": nullable({"type": "string"})}}
    return {
        "response_format": nullable({"type": "object", "required": ["type"], "additionalProperties": False,
                                     "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                                                    "json_schema": json_schema},
                                     "description": "json_schema needs json_schema"}),
        "structured_outputs": nullable({"type": "object", "additionalProperties": {"type": "null"},
                                        "description": "vLLM extension: exactly one of json, regex, choice, "
                                                       "json_object (true)",
                                        "properties": {"json": nullable({"anyOf": [schema, {"type": "string"}]}),
                                                       "regex": nullable(regex), "choice": nullable(choice),
                                                       "json_object": nullable({"type": "boolean"})}}),
        "guided_json": nullable({"anyOf": [schema, {"type": "string"}], "description": "vLLM extension"}),
        "guided_regex": nullable(regex), "guided_choice": nullable(choice),
    }


def completion_request(served: Sequence[str], context: int, vocab: int) -> dict:
    token_ids = {"type": "array", "minItems": 1, "items": integer(0, vocab - 1)}
    text = {"type": "string", "minLength": 1}
    prompt = {"anyOf": [text, token_ids, {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": text},
                        {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": token_ids}],
              "description": "text or token ids, or a batch of either (one choice per prompt and n)"}
    fields = {"prompt": prompt, "max_tokens": nullable(integer(0, context - 1, description="0 only with echo")),
              "echo": {"type": "boolean"}, "logprobs": nullable(integer(0, MAX_LOGPROBS)),
              "best_of": nullable(integer(1, MAX_SEQUENCES, description="at least n; not streamed above n"))}
    return _request(["prompt"], {**common_fields(served, context, vocab), **fields})


def messages_schema() -> dict:
    """A message of each role: content required but for an assistant's (which may only call tools); `name` on
    any; `tool_calls` only on an assistant's, `tool_call_id` only on a tool's."""
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}
    name = nullable({"type": "string", "minLength": 1})
    call = {"type": "object", "required": ["id", "type", "function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name", "arguments"],
                     "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}

    def message(roles: list[str], required: list[str], **properties: dict) -> dict:
        return {"type": "object", "required": ["role", *required], "additionalProperties": {"type": "null"},
                "properties": {"role": {"enum": roles}, "name": name, **properties}}
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        message([r for r in CHAT_ROLES if r not in ("assistant", "tool")], ["content"], content=content),
        message(["assistant"], [], content=nullable(content),
                tool_calls=nullable({"type": "array", "items": call})),
        message(["tool"], ["content"], content=content, tool_call_id=nullable({"type": "string"}))]}}


def chat_request(served: Sequence[str], context: int, vocab: int) -> dict:
    fields = {"messages": messages_schema(),
              "max_tokens": nullable(integer(1, context - 1)), "logprobs": {"type": "boolean"},
              "top_logprobs": nullable(integer(0, MAX_LOGPROBS, description="needs logprobs: true")),
              **tool_fields()}
    return _request(["messages"], {**common_fields(served, context, vocab), **fields})


def tool_fields() -> dict:
    """Function calling: the tools, which of them the model must or may call, and whether more than one."""
    function = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": nullable({"type": "string"}),
        "parameters": nullable({"type": "object", "description": "a JSON schema"}),
        "strict": nullable({"type": "boolean"})}}
    tool = {"type": "object", "required": ["type", "function"],
            "properties": {"type": {"const": "function"}, "function": function}}
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                    "properties": {"name": {"type": "string"}}}}}
    return {"tools": nullable({"type": "array", "minItems": 1, "maxItems": MAX_TOOLS, "items": tool,
                               "description": "distinct names"}),
            "tool_choice": nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, named],
                                     "description": "needs tools (but none); a named function must be among them"}),
            "parallel_tool_calls": nullable({"type": "boolean"})}


def tokenize_request(served: Sequence[str]) -> dict:
    """vLLM's /tokenize: a prompt, or messages (then add_special_tokens may only be false)."""
    flag = nullable({"type": "boolean"})
    model = nullable({"type": "string", "enum": list(served)})
    prompt = _request(["prompt"], {"model": model, "prompt": {"type": "string"}, "add_special_tokens": flag,
                                   "return_token_strs": flag})
    chat = _request(["messages"], {"model": model, "messages": messages_schema(),
                                   "add_special_tokens": nullable({"const": False}), "add_generation_prompt": flag,
                                   "return_token_strs": flag, "tools": tool_fields()["tools"]})
    return {"anyOf": [prompt, chat]}


def detokenize_request(served: Sequence[str], vocab: int) -> dict:
    return _request(["tokens"], {"model": nullable({"type": "string", "enum": list(served)}),
                                 "tokens": {"type": "array", "items": integer(0, vocab - 1)}})


TOKENIZED = {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"], "properties": {
    "count": integer(0), "max_model_len": integer(1), "tokens": {"type": "array", "items": integer(0)},
    "token_strs": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]}}}
DETOKENIZED = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}


def _tokens_post(summary: str, request: dict, ok: dict, keyed: bool) -> dict:
    return {"post": {"summary": summary, **_security(keyed),
                     "responses": {"200": _json(ok, "the answer"), **_errors(["400", "401"], keyed)},
                     "requestBody": {"required": True, "content": {"application/json": {"schema": request}}}}}


def _request(required: list[str], properties: dict) -> dict:
    """Any field it does not name is refused unless it is null (`additionalProperties` says so)."""
    return {"type": "object", "required": required, "properties": properties,
            "additionalProperties": {"type": "null"}}


NULLABLE_OBJECT = {"type": ["object", "null"]}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": integer(0), "completion_tokens": integer(0), "total_tokens": integer(0),
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": integer(0)}}}}
FINISH = {"enum": ["stop", "length", "tool_calls", None]}


def answer(kind: str, choice: dict, **extra: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
        "model": {"type": "string"}, "choices": {"type": "array", "minItems": 1, "items": choice}, "usage": USAGE,
        **extra}}


TOKEN_IDS = {"type": "array", "items": integer(0), "description": "with return_token_ids"}
TOOL_CALLS = {"type": "array", "items": {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}}}}}}
COMPLETION = answer("text_completion", {"type": "object", "required": ["index", "text", "logprobs", "finish_reason"],
                                        "properties": {"index": integer(0), "text": {"type": "string"},
                                                       "logprobs": NULLABLE_OBJECT, "finish_reason": FINISH,
                                                       "token_ids": TOKEN_IDS, "prompt_token_ids": TOKEN_IDS}})
CHAT = answer("chat.completion", {"type": "object", "required": ["index", "message", "logprobs", "finish_reason"],
                                  "properties": {"index": integer(0), "logprobs": NULLABLE_OBJECT,
                                                 "finish_reason": FINISH, "token_ids": TOKEN_IDS,
                                                 "message": {"type": "object", "required": ["role", "content"],
                                                             "properties": {"role": {"const": "assistant"},
                                                                            "content": {"type": ["string", "null"]},
                                                                            "tool_calls": TOOL_CALLS}}}},
              prompt_token_ids=TOKEN_IDS)
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}}}
CARD = {"type": "object", "required": ["id", "object", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}, "vocab_size": {"type": "integer"}}}

ERRORS = {
    "400": "bad input: malformed JSON, a field of the wrong type or out of bounds, an unsupported field, an unknown "
           "model, a prompt beyond the context",
    "401": "--api-key or --api-keys-file is set and the bearer token is missing or none of the keys",
    "429": "the conductor or the decode instance rejected the request (overload); see the Retry-After header",
    "500": "the engine failed the request",
    "503": "no prefill and decode instance can serve, or an instance refused the job",
    "504": "no progress (no token, nor a first within its predicted time) for --request-timeout-s",
}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(codes: Sequence[str], keyed: bool) -> dict:
    return {code: _json(ERROR, ERRORS[code]) for code in codes if code != "401" or keyed}


def _post(summary: str, request: dict, ok: dict, keyed: bool) -> dict:
    responses = {"200": {"description": "the answer, or server-sent events of it with stream: true",
                         "content": {"application/json": {"schema": ok}, "text/event-stream": {"schema": {}}}},
                 **_errors(list(ERRORS), keyed)}
    return {"post": {"summary": summary, **_security(keyed), "responses": responses,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": request}}}}}


def _security(keyed: bool) -> dict:
    return {"security": [{"bearer": []}]} if keyed else {}


def _get(summary: str, responses: dict) -> dict:
    return {"get": {"summary": summary, "responses": responses}}


def openapi_document(served: Sequence[str], context: int, vocab: int, keyed: bool) -> dict:
    """The document for a gateway serving `served` (the canonical name first); `keyed`: --api-key is set."""
    models = {"type": "object", "required": ["object", "data"],
              "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": CARD}}}
    model_path = {"get": {"summary": "the served model's card under any served name", **_security(keyed),
                          "parameters": [{"name": "model_id", "in": "path", "required": True,
                                          "schema": {"type": "string"}}],
                          "responses": {"200": _json(CARD, "the card"),
                                        "404": _json(ERROR, "not a served name"), **_errors(["401"], keyed)}}}
    status = {"type": "object"}
    document = {
        "openapi": "3.1.0",
        "info": {"title": "kvcentric gateway", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving '{served[0]}' (context {context} tokens)."},
        "paths": {
            "/v1/completions": _post("text completion", completion_request(served, context, vocab), COMPLETION,
                                     keyed),
            "/v1/chat/completions": _post("chat completion", chat_request(served, context, vocab), CHAT, keyed),
            "/tokenize": _tokens_post("vLLM's tokenize: the token ids of a prompt or of chat messages",
                                      tokenize_request(served), TOKENIZED, keyed),
            "/detokenize": _tokens_post("vLLM's detokenize: the text of token ids", detokenize_request(served, vocab),
                                        DETOKENIZED, keyed),
            "/v1/models": {"get": {"summary": "the served model", **_security(keyed),
                                   "responses": {"200": _json(models, "a list with one model card"),
                                                 **_errors(["401"], keyed)}}},
            "/v1/models/{model_id}": model_path,
            "/health": _get("gateway status and the engines the conductor sees (no key needed)",
                            {"200": _json(status, "ok"), "503": _json(status, "starting")}),
            "/ready": _get("whether the gateway can serve (no key needed)",
                           {"200": _json(status, "ready"), "503": _json(status, "not ready, and why")}),
            "/metrics": _get("Prometheus text format (no key needed)",
                             {"200": {"description": "metrics", "content": {"text/plain": {"schema": {}}}}}),
        },
    }
    if keyed:
        document["components"] = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
    return document
