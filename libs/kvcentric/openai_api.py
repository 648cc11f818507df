"""The OpenAI-compatible surface, without I/O: validate request bodies, shape responses and errors.

`parse_completion` turns a decoded JSON body into a `CompletionRequest` or raises `ApiError` (status,
OpenAI error type, message, param). The gateway service does the network part.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kvcentric.protocol import SamplingParams


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    sampling: SamplingParams
    stream: bool
    include_usage: bool


def _check(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise ApiError(400, message, param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    _check(isinstance(value, (int, float)) and not isinstance(value, bool),
           f"'{name}' must be a number, got {type(value).__name__}", name)
    _check(low <= value <= high, f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def _prompt(body: dict, vocab_size: int) -> tuple[str | None, list[int] | None]:
    _check("prompt" in body, "'prompt' is a required property", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        _check(len(prompt) > 0, "'prompt' must not be empty", "prompt")
        return prompt, None
    _check(isinstance(prompt, list) and len(prompt) > 0 and all(_is_int(t) for t in prompt),
           "'prompt' must be a string or a non-empty list of token ids (one prompt per request)", "prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    _check(not bad, f"token ids must be in [0, {vocab_size}); got {bad[:5]}", "prompt")
    return None, list(prompt)


def parse_completion(body: Any, served_model: str, vocab_size: int) -> CompletionRequest:
    """Validate a /v1/completions body (OpenAI schema plus vLLM's `ignore_eos`)."""
    _check(isinstance(body, dict), "the request body must be a JSON object", None)
    model = body.get("model", served_model)
    _check(isinstance(model, str), "'model' must be a string", "model")
    if model != served_model:
        raise ApiError(400, f"the model '{model}' does not exist; this server serves '{served_model}'",
                       "model", code="model_not_found")
    prompt, token_ids = _prompt(body, vocab_size)
    max_tokens = body.get("max_tokens", 16)
    _check(_is_int(max_tokens) and max_tokens >= 1, "'max_tokens' must be an integer >= 1", "max_tokens")
    n = body.get("n", 1)
    _check(n == 1 and _is_int(n), "only n=1 is supported", "n")
    seed = body.get("seed")
    _check(seed is None or _is_int(seed), "'seed' must be an integer", "seed")
    stream = body.get("stream", False)
    _check(isinstance(stream, bool), "'stream' must be a boolean", "stream")
    ignore_eos = body.get("ignore_eos", False)
    _check(isinstance(ignore_eos, bool), "'ignore_eos' must be a boolean", "ignore_eos")
    options = body.get("stream_options") or {}
    _check(isinstance(options, dict), "'stream_options' must be an object", "stream_options")
    sampling = SamplingParams(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                              top_p=_number(body, "top_p", 1.0, 1e-6, 1.0), seed=seed, ignore_eos=ignore_eos)
    return CompletionRequest(model, prompt, token_ids, sampling, stream, bool(options.get("include_usage")))


def check_context(n_prompt: int, max_tokens: int, max_model_len: int) -> None:
    """400 when prompt plus completion exceed the model's context, worded as OpenAI and vLLM do."""
    if n_prompt + max_tokens > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, "
                            f"{max_tokens} for the completion). Please reduce the length of the prompt "
                            f"or of the completion.", "prompt", code="context_length_exceeded")


def completion_body(request_id: str, model: str, text: str, finish_reason: str | None,
                    usage: dict | None, created: int | None = None) -> dict:
    """A text_completion object (whole answer) or one SSE chunk of it."""
    body = {"id": request_id, "object": "text_completion", "created": created or int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if usage is not None:
        body["usage"] = usage
    return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
