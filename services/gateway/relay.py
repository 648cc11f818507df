"""One request's way back to its client: token chunks from NATS become text pieces (stop strings
applied), and the pieces become one JSON answer or server-sent events in the completions or chat shape.

`Job` keeps what the gateway needs to account for the request (times, token counts, placement, how it
ended); the NATS and HTTP plumbing around it is in `kvc_gateway.service`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from kvc_gateway.textstream import TextStream
from kvcentric.core.openai_api import (ApiError, CompletionRequest, chat_body, chat_chunk, completion_body,
                                  usage)
from kvcentric.core.protocol import Placement, TokenChunk


ERROR_KINDS = {429: "rate_limit_exceeded", 500: "server_error", 503: "service_unavailable"}
"""The HTTP statuses an error chunk may carry (anything else is a 500), and their OpenAI error types."""


@dataclasses.dataclass
class Job:
    request_id: str
    request: CompletionRequest
    token_ids: list[int]
    chat: bool
    started: float
    """time.perf_counter() when the HTTP request arrived."""
    placement: Placement | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    engine_finished: bool = False
    """The engine finished the request itself, with a final chunk that is not an error (nothing left to
    cancel anywhere). An error chunk ends only the engine that sent it."""
    response: web.StreamResponse | None = None
    """The SSE response once it is prepared (its headers leave with the first event; errors after that go
    into the stream)."""
    dispatch_pending: bool = False
    """The conductor was asked to hand the request to the engines and has not answered yet: an ending now
    must cancel it on engines that may already have it."""
    output: Any = None
    """The NATS subscription to the request's kvc.req.<id>.out (a new one when the id is renewed)."""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    def usage(self) -> dict:
        cached = self.placement.cached_tokens if self.placement is not None else 0
        return usage(len(self.token_ids), self.completion_tokens, cached)

    def record_tokens(self, count: int, now: float, on_gap: Callable[[float], None]) -> None:
        """Count tokens that just arrived; report the time per token since the previous ones (TBT)."""
        if not count:
            return
        if self.first_token_at is None or self.last_token_at is None:
            self.first_token_at = now
        else:
            gap = (now - self.last_token_at) / count
            for _ in range(count):
                on_gap(gap)
        self.last_token_at = now
        self.completion_tokens += count


async def pieces(job: Job, chunks: AsyncIterator[TokenChunk], text: TextStream,
                 on_gap: Callable[[float], None]) -> AsyncIterator[tuple[str, str | None]]:
    """(text piece, finish_reason) pairs; the last one has the finish reason. An engine error is ApiError."""
    async for chunk in chunks:
        job.record_tokens(len(chunk.token_ids), time.perf_counter(), on_gap)
        if chunk.finish_reason == "error":
            status = chunk.error_status if chunk.error_status in ERROR_KINDS else 500
            headers = {"Retry-After": "1"} if status == 429 else None  # decode rejected it (TBT)
            raise ApiError(status, chunk.error or "generation failed", kind=ERROR_KINDS[status], headers=headers)
        piece = text.feed(chunk.token_ids)
        if chunk.finish_reason is not None and not text.stopped:
            job.engine_finished = True
            piece += text.finish()
        if text.stopped:
            job.finish_reason = "stop"
            yield piece, "stop"
            return
        if chunk.finish_reason is not None:
            job.finish_reason = chunk.finish_reason
            yield piece, chunk.finish_reason
            return
        if piece:
            yield piece, None
    raise ApiError(500, "the token stream ended early", kind="server_error")


# ---------------------------------------------------------------- answers


async def collect(job: Job, stream: AsyncIterator[tuple[str, str | None]], model: str,
                  headers: dict) -> web.Response:
    """The whole answer as one JSON body, `usage` included."""
    text = []
    async for piece, _finish_reason in stream:
        text.append(piece)
    shape = chat_body if job.chat else completion_body
    body = shape(job.request_id, model, "".join(text), job.finish_reason, job.usage())
    return web.json_response(body, headers=headers)


class EventStream(web.StreamResponse):
    """A streamed response whose headers go out with its first body bytes (one write, one wake-up of the
    client fewer before its first token) instead of on their own when it is prepared."""

    _send_headers_immediately = False  # aiohttp's switch (web.Response sets it the same way)


class EventWriter:
    """Server-sent events in OpenAI's format: `data: {json}` blocks, then `data: [DONE]`.

    Events are written as they come, except that the chat role event waits for the first piece and the
    last piece goes out with the usage event, `[DONE]` and the end of the body: every write is a system
    call and a wake-up of the client, and on loopback those are most of what a token costs here."""

    def __init__(self, job: Job, model: str) -> None:
        self.job, self.model, self.created = job, model, int(time.time())
        self.held: list[bytes] = []

    @property
    def response(self) -> web.StreamResponse:
        """The job's SSE response, which `open` prepared before any event is written."""
        assert self.job.response is not None, "an event is written before the stream is open"
        return self.job.response

    async def open(self, request: web.Request, headers: dict) -> web.StreamResponse:
        response = EventStream(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
        await response.prepare(request)
        self.job.response = response
        if self.job.chat:
            self.hold(chat_chunk(self.job.request_id, self.model, {"role": "assistant", "content": ""},
                                 None, None, self.created))
        return response

    async def piece(self, text: str, finish_reason: str | None) -> None:
        final_usage = self.job.usage() if finish_reason is not None else None
        if self.job.chat:
            delta = {"content": text} if text else {}
            body = chat_chunk(self.job.request_id, self.model, delta, finish_reason, final_usage, self.created)
        else:
            body = completion_body(self.job.request_id, self.model, text, finish_reason, final_usage, self.created)
        self.hold(body)
        if finish_reason is None:
            await self.response.write(self.take())

    async def close(self, include_usage: bool) -> None:
        if include_usage:  # OpenAI's extra last chunk: no choices, the usage
            shape: Callable[..., dict] = chat_chunk if self.job.chat else completion_body
            empty = {} if self.job.chat else ""
            body = shape(self.job.request_id, self.model, empty, None, self.job.usage(), self.created)
            body["choices"] = []
            self.hold(body)
        await self.response.write_eof(self.take() + b"data: [DONE]\n\n")

    async def error(self, error: ApiError) -> None:
        self.hold(error.body())
        await self.response.write_eof(self.take() + b"data: [DONE]\n\n")

    def hold(self, body: dict) -> None:
        self.held.append(b"data: " + json.dumps(body).encode() + b"\n\n")

    def take(self) -> bytes:
        held, self.held = b"".join(self.held), []
        return held


async def stream(request: web.Request, job: Job, pairs: AsyncIterator[tuple[str, str | None]], model: str,
                 headers: dict) -> web.StreamResponse:
    """Relay the pieces as SSE. The headers go out with the first piece, so a request that fails before its
    first token (an instance refused it, the engine failed) still gets its HTTP status; an error after
    that becomes an error event."""
    writer = EventWriter(job, model)
    try:
        async for piece, finish_reason in pairs:
            if job.response is None:
                await writer.open(request, headers)
            if piece or finish_reason is not None:
                await writer.piece(piece, finish_reason)
    except ApiError as exc:
        if job.response is None:
            raise
        await writer.error(exc)
        return writer.response
    await writer.close(job.request.include_usage)
    return writer.response
