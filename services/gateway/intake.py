"""What comes into the gateway, checked: the API key, the JSON body, and a completion or chat completion made
into validated, tokenized jobs (`relay.Job`). Every refusal is an `ApiError` (an OpenAI-shaped 4xx); it places,
sends and answers nothing itself. The field rules are `kvcentric.core.openai_api`'s.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import uuid

import msgspec
from aiohttp import web

from kvc_gateway import relay
from kvc_gateway.config import GatewayConfig
from kvcentric.core.metrics import labelled
from kvcentric.core.openai_api import ApiError, check_context, parse_chat, parse_completion
from kvcentric.model.tokenizer import ChatTemplateError
from kvcentric.runtime.http import error_response
from kvcentric.runtime.security import key_matches

MAX_REQUEST_ID = 256
"""Longest X-Request-ID echoed back; a longer one is replaced by the gateway's own id."""
OPEN_PATHS = ("/health", "/ready", "/metrics", "/openapi.json")
"""What answers without an API key."""


def client_request_id(request: web.Request) -> str:
    """The client's X-Request-ID, echoed back as it is (printable, at most 256 characters), else ""."""
    value = request.headers.get("X-Request-ID", "")
    return value if len(value) <= MAX_REQUEST_ID and value.isprintable() else ""


def api_key_check(api_keys: tuple[str, ...], counters: collections.Counter[str]):
    """The middleware that, with --api-key or --api-keys-file, asks a key of everything but health, metrics and
    the API description."""

    @web.middleware
    async def check_api_key(request: web.Request, handler):
        if api_keys and request.path not in OPEN_PATHS:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not key_matches(token.strip(), api_keys):
                counters[labelled("requests_total", outcome="401")] += 1
                return error_response(ApiError(401, "Incorrect or missing API key: send the header "
                                                    "'Authorization: Bearer <key>' (a key of the gateway's "
                                                    "--api-key or --api-keys-file).",
                                               code="invalid_api_key",
                                               headers={"WWW-Authenticate": "Bearer"}))
        return await handler(request)

    return check_api_key


async def request_body(request: web.Request):
    """The request's JSON body; a 400 for what is not JSON."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    except LookupError:
        raise ApiError(400, f"unknown charset {request.charset!r} in Content-Type: send UTF-8 JSON") from None
    except RecursionError:
        raise ApiError(400, "the JSON body is nested too deeply") from None


class Intake:
    """Completions and chat completions into jobs, against the served model's names, context and vocabulary."""

    def __init__(self, config: GatewayConfig, tokenizer) -> None:
        self.config, self.model, self.tokenizer = config, config.model_config, tokenizer

    async def parse(self, request: web.Request, chat: bool, started: float) -> list[relay.Job]:
        body = await request_body(request)
        try:
            return self.jobs_of(body, chat, started)
        except UnicodeEncodeError:
            raise ApiError(400, "the text is not valid Unicode (it holds a lone surrogate escape)") from None
        except ChatTemplateError as exc:
            raise ApiError(400, f"the model's chat template refused the messages: {exc}", "messages") from None

    def jobs_of(self, body, chat: bool, started: float) -> list[relay.Job]:
        """The validated, tokenized request: one job, or one per prompt of a batch (sharing its id)."""
        context = self.model.max_position
        if chat:
            parsed = parse_chat(body, self.config.served_names, context, self.model.vocab_size)
            shown = parsed.tools.shown if parsed.tools is not None else None
            token_ids = self.tokenizer.encode_chat(parsed.messages, tools=shown)
            if parsed.max_tokens_defaulted:
                sampling = msgspec.structs.replace(parsed.sampling, max_tokens=max(1, context - len(token_ids)))
                parsed = dataclasses.replace(parsed, sampling=sampling)
            check_context(len(token_ids), parsed.sampling.max_tokens, context)
            return [relay.Job(f"chatcmpl-{uuid.uuid4().hex}", parsed, token_ids, chat, started)]
        parsed = parse_completion(body, self.config.served_names, self.model.vocab_size)
        request_id, prompts = f"cmpl-{uuid.uuid4().hex}", parsed.each_prompt()
        jobs = []
        for index, one in enumerate(prompts):
            token_ids = one.prompt_token_ids or self.tokenizer.encode(one.prompt)
            check_context(len(token_ids), one.sampling.max_tokens, context)
            jobs.append(relay.Job(request_id, one, token_ids, chat, started,
                                  batch_index=index if len(prompts) > 1 else None))
        return jobs
