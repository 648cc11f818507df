"""The gateway's OpenAPI 3.1 description (GET /openapi.json): every endpoint, the request fields with the
types and bounds `kvcentric.core.openai_api` enforces, the answers' shapes and the errors.

What a schema cannot say (prompt plus max_tokens within the context, min_tokens at most max_tokens,
best_of at least n, logit_bias ids within the vocabulary, max_tokens 0 only with echo) the server checks
as well and answers with a 400; whatever the schema forbids, the server refuses.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcentric.core.openai_api import CHAT_ROLES, MAX_LOGIT_BIAS, MAX_PRIORITY, MAX_TOP_K, SEED_MAX, SEED_MIN
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
        "stream_options": nullable({"type": "object", "properties": {
            "include_usage": nullable({"type": "boolean"})}}),
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
    }


def completion_request(served: Sequence[str], context: int, vocab: int) -> dict:
    token_ids = {"type": "array", "minItems": 1, "items": integer(0, vocab - 1)}
    text = {"type": "string", "minLength": 1}
    prompt = {"anyOf": [text, token_ids, {"type": "array", "minItems": 1, "maxItems": 1, "items": text},
                        {"type": "array", "minItems": 1, "maxItems": 1, "items": token_ids}],
              "description": "text or token ids, or a batch of one of either"}
    fields = {"prompt": prompt, "max_tokens": nullable(integer(0, context - 1, description="0 only with echo")),
              "echo": {"type": "boolean"}, "logprobs": nullable(integer(0, MAX_LOGPROBS)),
              "best_of": nullable(integer(1, MAX_SEQUENCES, description="at least n; not streamed above n"))}
    return _request(["prompt"], {**common_fields(served, context, vocab), **fields})


def chat_request(served: Sequence[str], context: int, vocab: int) -> dict:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": list(CHAT_ROLES)},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}, {"type": "null"}],
                    "description": "null only for the assistant"}}}
    fields = {"messages": {"type": "array", "minItems": 1, "items": message},
              "max_tokens": nullable(integer(1, context - 1)), "logprobs": {"type": "boolean"},
              "top_logprobs": nullable(integer(0, MAX_LOGPROBS, description="needs logprobs: true"))}
    return _request(["messages"], {**common_fields(served, context, vocab), **fields})


def _request(required: list[str], properties: dict) -> dict:
    """Any field it does not name is refused unless it is null (`additionalProperties` says so)."""
    return {"type": "object", "required": required, "properties": properties,
            "additionalProperties": {"type": "null"}}


NULLABLE_OBJECT = {"type": ["object", "null"]}
USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": integer(0), "completion_tokens": integer(0), "total_tokens": integer(0),
    "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": integer(0)}}}}
FINISH = {"enum": ["stop", "length", None]}


def answer(kind: str, choice: dict, **extra: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
        "model": {"type": "string"}, "choices": {"type": "array", "minItems": 1, "items": choice}, "usage": USAGE,
        **extra}}


TOKEN_IDS = {"type": "array", "items": integer(0), "description": "with return_token_ids"}
COMPLETION = answer("text_completion", {"type": "object", "required": ["index", "text", "logprobs", "finish_reason"],
                                        "properties": {"index": integer(0), "text": {"type": "string"},
                                                       "logprobs": NULLABLE_OBJECT, "finish_reason": FINISH,
                                                       "token_ids": TOKEN_IDS, "prompt_token_ids": TOKEN_IDS}})
CHAT = answer("chat.completion", {"type": "object", "required": ["index", "message", "logprobs", "finish_reason"],
                                  "properties": {"index": integer(0), "logprobs": NULLABLE_OBJECT,
                                                 "finish_reason": FINISH, "token_ids": TOKEN_IDS,
                                                 "message": {"type": "object", "required": ["role", "content"],
                                                             "properties": {"role": {"const": "assistant"},
                                                                            "content": {"type": "string"}}}}},
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
