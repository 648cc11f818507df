"""The gateway's OpenAPI 3.1 description (GET /openapi.json): the endpoints, their parameters and errors."""

from __future__ import annotations

SAMPLING = {
    "model": {"type": "string", "description": "must name the served model (else 400)"},
    "max_tokens": {"type": "integer", "minimum": 1, "description": "completion tokens at most (default 16; "
                                                                   "chat: what is left of the context)"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 1},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": 1},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}],
             "description": "the output ends before the first of these strings (finish_reason 'stop')"},
    "stream": {"type": "boolean", "default": False, "description": "server-sent events ending in data: [DONE]"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": "integer", "enum": [1], "description": "only 1 (else 400)"},
    "user": {"type": "string"},
    "ignore_eos": {"type": "boolean", "default": False, "description": "vLLM extension: generate max_tokens"},
    "top_k": {"type": "integer", "minimum": -1, "default": 0, "description": "vLLM extension: sample among the "
                                                                           "k likeliest tokens (0 or -1: all)"},
    "priority": {"type": "integer", "minimum": -1000, "maximum": 1000, "default": 0,
                 "description": "vLLM extension, lower is more important: under overload the conductor rejects "
                                "priority p > 0 from a load of 1 - priority_step * p"},
}

ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}

ERRORS = {
    "400": "bad input: malformed JSON, a wrong field, an unknown model, n > 1, a prompt beyond the context",
    "401": "--api-key is set and the bearer token is missing or wrong",
    "429": "the conductor rejected the request (overload); see the Retry-After header",
    "500": "the engine failed the request",
    "503": "no prefill and decode instance can serve, or an instance refused the job",
    "504": "not finished within --request-timeout-s",
}


def _responses(ok: str) -> dict:
    errors = {code: {"description": text, "content": {"application/json": {"schema": ERROR}}}
              for code, text in ERRORS.items()}
    return {"200": {"description": ok}, **errors}


def _post(summary: str, required: list[str], extra: dict, ok: str) -> dict:
    schema = {"type": "object", "required": required, "properties": {**extra, **SAMPLING}}
    return {"post": {"summary": summary, "security": [{"bearer": []}],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                     "responses": _responses(ok)}}


def openapi_document(model: str) -> dict:
    prompt = {"prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}],
                         "description": "text, or token ids"}}
    messages = {"messages": {"type": "array", "items": {"type": "object", "required": ["role", "content"],
                                                        "properties": {"role": {"type": "string"},
                                                                       "content": {"type": "string"}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvcentric gateway", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving '{model}'."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/completions": _post("text completion", ["prompt"], prompt,
                                     "a text_completion object, or chunks of it as SSE"),
            "/v1/chat/completions": _post("chat completion", ["messages"], messages,
                                          "a chat.completion object, or chat.completion.chunk SSE"),
            "/v1/models": {"get": {"summary": "the served model", "security": [{"bearer": []}],
                                   "responses": {"200": {"description": "a list with one model card"}}}},
            "/health": {"get": {"summary": "gateway status and the engines the conductor sees (no key needed)",
                                "responses": {"200": {"description": "ok"}, "503": {"description": "starting"}}}},
            "/metrics": {"get": {"summary": "Prometheus text format (no key needed)",
                                 "responses": {"200": {"description": "metrics"}}}},
        },
    }
