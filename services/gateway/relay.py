"""One request's way back to its client: token chunks from NATS become text pieces of each choice (stop
strings applied per choice, logprobs alongside), and the pieces become one JSON answer or server-sent
events in the completions or chat shape (echo, logprobs, best_of's choice of the likeliest included).

`Job` keeps what the gateway needs to account for the request (times, token counts, placement, how it
ended); the NATS and HTTP plumbing around it is in `kvc_gateway.service`.

A request is timed out for silence, not for length (`watched`): it ends with a 504 only when no token came for
--request-timeout-s, counted before its first token from when its placement predicted that token. A stream that
opens (status and headers) once the request is placed, and while it waits sends SSE comments (keep-alives) every
--keepalive-s.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from kvc_gateway.textstream import TextStream
from kvcentric.core.openai_api import (ApiError, CompletionRequest, chat_body, chat_chunk, completion_body,
                                       usage)
from kvcentric.core.openai_tools import ToolCallStream, split_answer
from kvcentric.core.openai_logprobs import TokenText, chat_logprobs, completion_logprobs, merge_completion_logprobs
from kvcentric.core.migration import Failure
from kvcentric.core.protocol import Placement, TokenChunk, TokenLogprob


T = TypeVar("T")

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
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    """Echo with logprobs: the prompt's tokens 1.. as the prefill scored them (from the first chunk)."""
    bus_id: str = ""
    """The request's id on the bus (`kvc.req.<id>.*`, the jobs): its request_id, with a suffix for each
    migration so that the instances it left can neither mix into its stream nor be cancelled with it."""
    received: list[int] = dataclasses.field(default_factory=list)
    """The tokens of its first sequence that reached the gateway (what a migration goes on after)."""
    received_before: int = 0
    placed_at: float = math.inf
    """When its current placement was made (time.monotonic()): an instance restarted since has lost it."""
    """Of `received`, the tokens that came before its current placement (a migration's continuation)."""
    migrations: int = 0
    failure: Failure | None = None
    """Set when its placement cannot finish it (an instance went silent or failed it): it is migrating."""
    avoid: list[str] = dataclasses.field(default_factory=list)
    """Instances that failed it (a migration is not placed on them)."""
    stalled_at: float | None = None
    """time.perf_counter() of the last token before a migration, until a token comes after it."""
    cached_tokens: int | None = None
    """Prompt tokens found cached at its first placement (the usage's `cached_tokens`)."""
    first_token_told: bool = False
    """Its first token was told to the conductors (kvc.conductor.first_token), or will not be."""
    progress_at: float = 0.0
    """time.perf_counter() of its latest progress: its latest token, or, before one came, the moment its latest
    placement predicted the first (a request is cut only after --request-timeout-s of silence from this)."""
    answered: bool = False
    """Every one of its choices ended (`pieces` returned)."""
    batch_index: int | None = None
    """Which prompt of a batched completion request it serves (None: the request has one prompt). The prompts of
    a batch share the client's `request_id`; each has a bus id of its own."""

    def __post_init__(self) -> None:
        self.bus_id = self.bus_id or self.own_id

    @property
    def own_id(self) -> str:
        """Its id on the bus before any migration: the request's id, with the prompt's index in a batch."""
        return self.request_id if self.batch_index is None else f"{self.request_id}-p{self.batch_index}"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    def usage(self) -> dict:
        return usage(len(self.token_ids), self.completion_tokens, self.cached_tokens or 0)

    def record_tokens(self, count: int, now: float, on_gap: Callable[[float], None]) -> None:
        """Count tokens that just arrived; report the time per token since the previous ones (TBT)."""
        if not count:
            return
        self.progress_at = now
        if self.first_token_at is None or self.last_token_at is None:
            self.first_token_at = now
        else:
            gap = (now - self.last_token_at) / count
            for _ in range(count):
                on_gap(gap)
        self.last_token_at = now
        self.completion_tokens += count


@dataclasses.dataclass
class Piece:
    """Text safe to send, the tokens whose logprobs go with it (when asked for), and how the choice ended."""

    text: str
    finish_reason: str | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    """The tokens it carries when logprobs or token ids were asked for."""
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    index: int = 0
    """The choice (one of the request's n sequences)."""


class Choice:
    """One sequence's way from tokens to pieces: its own detokenizer and stop strings."""

    def __init__(self, index: int, text: TextStream) -> None:
        self.index, self.text = index, text
        self.pending = Piece("", index=index)
        self.done = self.engine_done = False

    def take(self, job: Job, chunk: TokenChunk, tokens: list[int]) -> Piece | None:
        """The piece these tokens release (None when they release nothing yet)."""
        pending = self.pending
        if tokens and (chunk.logprobs or job.request.return_token_ids):
            pending.token_ids += tokens
            pending.logprobs += chunk.logprobs
        pending.text = self.text.feed(tokens)
        self.engine_done = chunk.finish_reason is not None
        if self.engine_done and not self.text.stopped:
            pending.text += self.text.finish()
        if self.text.stopped or self.engine_done:
            self.done = True
            reason = "stop" if self.text.stopped else chunk.finish_reason
            pending.finish_reason = job.finish_reason = "length" if job.request.discard_output else reason
            return pending
        if not (pending.text or pending.token_ids):
            return None
        self.pending = Piece("", index=self.index)
        return pending


async def pieces(job: Job, chunks: AsyncIterator[TokenChunk], new_text: Callable[[], TextStream],
                 on_gap: Callable[[float], None]) -> AsyncIterator[Piece]:
    """Pieces of the answer, each of one choice; the last of each choice has its finish reason. An engine
    error is ApiError. A token's logprobs go out with the piece that releases its text (stop strings hold
    text back). A choice cut by a stop string ignores what its sequence still generates."""
    choices = [Choice(index, new_text()) for index in range(job.request.sampling.n)]
    async for chunk in chunks:
        if chunk.prompt_logprobs:
            job.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason == "error":
            status = chunk.error_status if chunk.error_status in ERROR_KINDS else 500
            headers = {"Retry-After": "1"} if status in (429, 503) else None  # refused or gone: worth a retry
            raise ApiError(status, chunk.error or "generation failed", kind=ERROR_KINDS[status], headers=headers)
        if not 0 <= chunk.index < len(choices) or choices[chunk.index].done:
            continue
        tokens = [] if job.request.discard_output else chunk.token_ids
        job.record_tokens(len(tokens), time.perf_counter(), on_gap)
        piece = choices[chunk.index].take(job, chunk, tokens)
        if piece is not None:
            yield piece
        if all(choice.done for choice in choices):
            job.engine_finished = all(choice.engine_done for choice in choices)
            job.answered = True
            return
    raise ApiError(500, "the token stream ended early", kind="server_error")


class Shaper:
    """The choices' text and logprobs as the client sees them: echo puts the prompt (and its logprobs) first
    in each choice; logprobs take the completions or the chat shape; text offsets run on across pieces."""

    def __init__(self, job: Job, text_of: TokenText, prompt_text: str) -> None:
        self.job, self.text_of, self.prompt_text = job, text_of, prompt_text
        self.echoed_text: set[int] = set()
        self.echoed_logprobs: set[int] = set()
        self.offsets: dict[int, int] = {}
        self.prompt_ids_given = False

    def prompt_token_ids(self, body: dict) -> None:
        """vLLM's `return_token_ids`: the prompt's ids, in each choice of a completion or at the top of a chat
        answer, once (a stream's first event)."""
        if self.prompt_ids_given:
            return
        self.prompt_ids_given = True
        if self.job.chat:
            body["prompt_token_ids"] = self.job.token_ids
        else:
            for choice in body["choices"]:
                choice["prompt_token_ids"] = self.job.token_ids

    def text(self, piece: Piece) -> str:
        if not self.job.request.echo or piece.index in self.echoed_text:
            return piece.text
        self.echoed_text.add(piece.index)
        return self.prompt_text + piece.text

    def logprobs(self, piece: Piece) -> dict | None:
        if not self.job.request.show_logprobs:
            return None
        if self.job.chat:
            return chat_logprobs(piece.logprobs, self.text_of)
        entries: list[TokenLogprob | None] = list(piece.logprobs)
        token_ids = list(piece.token_ids)
        if self.job.request.echo and piece.index not in self.echoed_logprobs:
            self.echoed_logprobs.add(piece.index)
            entries = [None, *self.job.prompt_logprobs, *entries]
            token_ids = [*self.job.token_ids, *token_ids]
        offset = self.offsets.get(piece.index, 0)
        shaped = completion_logprobs(entries, token_ids, self.text_of, offset)
        self.offsets[piece.index] = offset + sum(len(token) for token in shaped["tokens"])
        return shaped


async def watched(job: Job, stream: AsyncIterator[T], silence_s: float, keepalive_s: float = 0.0,
                  keep_alive: Callable[[], Awaitable[None]] | None = None) -> AsyncIterator[T]:
    """The pieces of `stream` as they come; TimeoutError once nothing has progressed for `silence_s` (from
    `job.progress_at`: its latest token, or when its placement predicted the first); `keep_alive` awaited after
    every `keepalive_s` without a piece (0: never)."""
    pieces = aiter(stream)
    upcoming: asyncio.Future = asyncio.ensure_future(anext(pieces))
    try:
        while True:
            silent_at = max(job.progress_at, job.started) + silence_s
            wait = silent_at - time.perf_counter()
            if keepalive_s > 0:
                wait = min(wait, keepalive_s)
            done, _ = await asyncio.wait({upcoming}, timeout=max(0.0, wait))
            if done:
                try:
                    piece = upcoming.result()
                except StopAsyncIteration:
                    return
                yield piece
                upcoming = asyncio.ensure_future(anext(pieces))
            elif time.perf_counter() >= max(job.progress_at, job.started) + silence_s:
                raise TimeoutError
            elif keep_alive is not None:
                await keep_alive()
    finally:
        upcoming.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
            await upcoming


# ---------------------------------------------------------------- answers


async def collect(job: Job, stream: AsyncIterator[Piece], model: str, headers: dict,
                  shaper: Shaper, silence_s: float = float("inf")) -> web.Response:
    """The whole answer as one JSON response (`collect_body`)."""
    return web.json_response(await collect_body(job, stream, model, shaper, silence_s), headers=headers)


async def collect_body(job: Job, stream: AsyncIterator[Piece], model: str, shaper: Shaper,
                       silence_s: float = float("inf")) -> dict:
    """The whole answer as one JSON body, `usage` included; with best_of, the n choices whose tokens are
    likeliest (the highest sum of logprobs). TimeoutError after `silence_s` without progress (`watched`)."""
    texts: dict[int, list[str]] = collections.defaultdict(list)
    token_ids: dict[int, list[int]] = collections.defaultdict(list)
    shaped: dict[int, list[dict]] = collections.defaultdict(list)
    sums: dict[int, float] = collections.defaultdict(float)
    reasons: dict[int, str | None] = {}
    async for piece in watched(job, stream, silence_s):
        texts[piece.index].append(shaper.text(piece))
        token_ids[piece.index] += piece.token_ids
        sums[piece.index] += sum(entry.logprob for entry in piece.logprobs)
        reasons[piece.index] = piece.finish_reason
        logprobs = shaper.logprobs(piece)
        if logprobs is not None:
            shaped[piece.index].append(logprobs)
    kept = sorted(sorted(texts, key=lambda index: -sums[index])[:job.request.n])
    choices = [_choice(job, model, position, "".join(texts[index]), reasons[index], shaped[index])
               for position, index in enumerate(kept)]
    shape = chat_body if job.chat else completion_body
    body = shape(job.request_id, model, "", None, job.usage())
    body["choices"] = choices
    if job.request.return_token_ids:
        for choice, index in zip(choices, kept):
            choice["token_ids"] = token_ids[index]
        shaper.prompt_token_ids(body)
    return body


def _choice(job: Job, model: str, index: int, text: str, finish_reason: str | None, shaped: list[dict]) -> dict:
    if job.chat:
        merged = {"content": [t for part in shaped for t in part["content"]], "refusal": None} if shaped else None
        choice = chat_body(job.request_id, model, text, finish_reason, None, logprobs=merged, index=index)["choices"][0]
        names = called_names(job)
        if names:
            content, calls = split_answer(text, names)
            if calls:
                choice["message"].update(content=content, tool_calls=calls)
                choice["finish_reason"] = tool_finish(finish_reason)
        return choice
    return completion_body(job.request_id, model, text, finish_reason, None,
                           logprobs=merge_completion_logprobs(shaped), index=index)["choices"][0]


def called_names(job: Job) -> set[str]:
    """The functions a chat request's answer may call (none unless it declared tools, tool_choice not none)."""
    tools = job.request.tools
    return tools.names if tools is not None and tools.choice != "none" else set()


def tool_finish(reason: str | None) -> str | None:
    """OpenAI's finish reason of a choice that called tools: `tool_calls` where the model ended it."""
    return "tool_calls" if reason == "stop" else reason


class EventStream(web.StreamResponse):
    """A streamed response whose headers go out with its first body bytes (one write, one wake-up of the
    client fewer before its first token) instead of on their own when it is prepared."""

    _send_headers_immediately = False  # aiohttp's switch (web.Response sets it the same way)


class EventWriter:
    """Server-sent events in OpenAI's format: `data: {json}` blocks, then `data: [DONE]`.

    Events are written as they come, except that the chat role event waits for the first piece and the
    last piece goes out with the usage event, `[DONE]` and the end of the body: every write is a system
    call and a wake-up of the client, and on loopback those are most of what a token costs here."""

    def __init__(self, job: Job, model: str, shaper: Shaper, offset: int = 0) -> None:
        self.job, self.model, self.shaper, self.created = job, model, shaper, int(time.time())
        self.held: list[bytes] = []
        self.offset = offset
        """Added to each choice's index: i*n for the i-th prompt of a batch (OpenAI's order)."""
        names = called_names(job)
        self.calls = {index: ToolCallStream(names) for index in range(job.request.sampling.n)} if names else {}
        """Chat with tools: each choice's tool calls, taken out of its text as they close."""
        self.called: dict[int, int] = collections.Counter()

    @property
    def response(self) -> web.StreamResponse:
        """The job's SSE response, which `open` prepared before any event is written."""
        assert self.job.response is not None, "an event is written before the stream is open"
        return self.job.response

    async def open(self, request: web.Request, headers: dict, at_once: bool = False) -> web.StreamResponse:
        """Prepare the SSE response; its status and headers leave with the first event, or now where `at_once` (a
        request placed before its first token: the client learns at once that it was admitted)."""
        response = EventStream(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
        response._send_headers_immediately = at_once
        await response.prepare(request)
        self.job.response = response
        if self.job.chat:
            for index in range(self.job.request.n):
                self.hold(self.token_ids(chat_chunk(self.job.request_id, self.model,
                                                    {"role": "assistant", "content": ""}, None, None, self.created,
                                                    index=index)))
        return response

    def token_ids(self, body: dict, piece: Piece | None = None) -> dict:
        """vLLM's `return_token_ids` on one event: the piece's tokens, and the prompt's in the first event."""
        if self.job.request.return_token_ids:
            if piece is not None:
                body["choices"][0]["token_ids"] = piece.token_ids
            self.shaper.prompt_token_ids(body)
        return body

    async def piece(self, piece: Piece) -> None:
        text, logprobs = self.shaper.text(piece), self.shaper.logprobs(piece)
        if self.job.chat:
            delta, finish = self.delta(piece, text)
            body = chat_chunk(self.job.request_id, self.model, delta, finish, None, self.created,
                              logprobs=logprobs, index=self.offset + piece.index)
        else:
            body = completion_body(self.job.request_id, self.model, text, piece.finish_reason, None, self.created,
                                   logprobs=logprobs, index=self.offset + piece.index)
        self.hold(self.token_ids(body, piece))
        if piece.finish_reason is None:
            await self.response.write(self.take())

    def delta(self, piece: Piece, text: str) -> tuple[dict, str | None]:
        """A chat event's delta and finish reason: its text, or with tools the content and the tool calls that
        closed in it (`delta.tool_calls`, each whole, indexed per choice)."""
        calls_of = self.calls.get(piece.index)
        if calls_of is None:
            return ({"content": text} if text else {}), piece.finish_reason
        content, calls = calls_of.feed(text)
        if piece.finish_reason is not None:
            content += calls_of.finish()
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            first = self.called[piece.index]
            delta["tool_calls"] = [{"index": first + k, **call} for k, call in enumerate(calls)]
            self.called[piece.index] += len(calls)
        called = self.called[piece.index] > 0
        return delta, tool_finish(piece.finish_reason) if called else piece.finish_reason

    async def close(self, total: dict | None = None) -> None:
        """The held events, the usage chunk when asked for (`total`, a batch's, or the job's), `[DONE]`."""
        if self.job.request.include_usage:  # OpenAI's extra last chunk: no choices, the usage
            shape: Callable[..., dict] = chat_chunk if self.job.chat else completion_body
            empty = {} if self.job.chat else ""
            body = shape(self.job.request_id, self.model, empty, None, total or self.job.usage(), self.created)
            body["choices"] = []
            self.hold(body)
        await self.response.write_eof(self.take() + b"data: [DONE]\n\n")

    async def keep_alive(self, request: web.Request, headers: dict) -> None:
        """An SSE comment, the stream opened first (its status and headers go out with it)."""
        if self.job.response is None:
            await self.open(request, headers)
        await self.response.write(self.take() + b": keep-alive\n\n")

    async def error(self, error: ApiError) -> None:
        self.hold(error.body())
        await self.response.write_eof(self.take() + b"data: [DONE]\n\n")

    def hold(self, body: dict) -> None:
        if self.job.request.continuous_usage and body.get("choices"):  # vLLM: the usage so far on every chunk
            body["usage"] = self.job.usage()
        elif self.job.request.include_usage and "choices" in body:  # OpenAI: usage null on all chunks but the last
            body.setdefault("usage", None)
        self.held.append(b"data: " + json.dumps(body).encode() + b"\n\n")

    def take(self) -> bytes:
        held, self.held = b"".join(self.held), []
        return held


async def stream(request: web.Request, job: Job, pieces: AsyncIterator[Piece], model: str, headers: dict,
                 shaper: Shaper, silence_s: float = float("inf"), keepalive_s: float = 0.0,
                 open_now: bool = True) -> web.StreamResponse:
    """Relay the pieces as SSE. The request is placed: with `open_now` its status and headers go out now, so a client
    sees at once that it was admitted (a queued burst may wait seconds for its first token); else (its decode
    instance may still refuse it when the KV has arrived, `Placement.decode_tbt_check`) with the first piece or the
    first keep-alive, so such a refusal still gets its own status. A keep-alive comment goes out every `keepalive_s`
    of waiting; an error once the stream is open (an instance failed and the request could not be migrated) becomes
    an error event. TimeoutError after `silence_s` without progress (`watched`)."""
    writer = EventWriter(job, model, shaper)

    async def keep_alive() -> None:
        await writer.keep_alive(request, headers)
    if open_now:
        await writer.open(request, headers, at_once=True)
    try:
        async for piece in watched(job, pieces, silence_s, keepalive_s, keep_alive):
            if job.response is None:
                await writer.open(request, headers)
            await writer.piece(piece)
    except ApiError as exc:
        if job.response is None:
            raise
        await writer.error(exc)
        return writer.response
    await writer.close()
    return writer.response
