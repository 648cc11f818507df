"""The gateway's small endpoints beside the completions: the model list and card, the OpenAPI description, and
vLLM's /tokenize and /detokenize. They read the served model and its tokenizer; nothing reaches the bus.
"""

from __future__ import annotations

from aiohttp import web

from kvc_gateway.config import GatewayConfig
from kvc_gateway.intake import request_body
from kvc_gateway.openapi import openapi_document
from kvcentric.core.openai_api import ApiError, parse_detokenize, parse_tokenize
from kvcentric.model.tokenizer import ChatTemplateError
from kvcentric.runtime.http import error_response


class Endpoints:
    """GET /v1/models, /v1/models/{id}, /openapi.json; POST /tokenize, /detokenize."""

    def __init__(self, config: GatewayConfig, tokenizer, keyed: bool) -> None:
        """`keyed`: /v1/* asks for an API key (the OpenAPI description says so)."""
        self.config, self.model, self.tokenizer, self.keyed = config, config.model_config, tokenizer, keyed
        self.model_name = config.served_names[0]

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id}", self.model_card)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    def card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvcentric",
                "max_model_len": self.model.max_position, "vocab_size": self.model.vocab_size}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self.card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the served model's card under any of its served names, else a 404."""
        model_id = request.match_info["model_id"]
        if model_id not in self.config.served_names:
            return error_response(ApiError(404, f"the model '{model_id}' does not exist; this server serves "
                                                f"{', '.join(self.config.served_names)}", param="model",
                                           kind="not_found_error", code="model_not_found"))
        return web.json_response(self.card())

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(self.config.served_names, self.model.max_position,
                                                  self.model.vocab_size, self.keyed))

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /tokenize: the ids a prompt (or messages, rendered as a chat request is) becomes."""
        asked = parse_tokenize(await request_body(request), self.config.served_names)
        try:
            if asked.messages is not None:
                tokens = self.tokenizer.encode_chat(asked.messages, asked.add_generation_prompt, asked.tools)
            else:
                tokens = self.tokenizer.encode(asked.prompt or "", add_bos=asked.add_special_tokens)
        except UnicodeEncodeError:
            raise ApiError(400, "the text is not valid Unicode (it holds a lone surrogate escape)") from None
        except ChatTemplateError as exc:
            raise ApiError(400, f"the model's chat template refused the messages: {exc}", "messages") from None
        strs = [self.tokenizer.token_str(token) for token in tokens] if asked.return_token_strs else None
        return web.json_response({"count": len(tokens), "max_model_len": self.model.max_position,
                                  "tokens": tokens, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /detokenize: the text of token ids."""
        tokens = parse_detokenize(await request_body(request), self.config.served_names, self.model.vocab_size)
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})
