"""A completion request that batches several prompts: each prompt runs as a job of its own (placed, relayed,
migrated and accounted alone, `kvc_gateway.relay`), and this module answers them as one, in OpenAI's order
(prompt i's n choices at indices i*n .. i*n+n-1), with the usage summed. It talks to neither NATS nor the
engines; `kvc_gateway.service` opens the jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any, TypeVar

from aiohttp import web

from kvc_gateway.relay import EventWriter, Job, Piece, Shaper, collect_body, watched
from kvcentric.core.openai_api import ApiError, usage

T = TypeVar("T")


async def all_or_none(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Await them together; on the first failure the others are cancelled (and awaited) and it is raised."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(jobs: list[Job]) -> dict:
    """The batch's usage: its prompts' tokens, generated tokens and cached tokens, summed."""
    return usage(sum(len(job.token_ids) for job in jobs), sum(job.completion_tokens for job in jobs),
                 sum(job.cached_tokens or 0 for job in jobs))


async def collect(jobs: list[Job], streams: list[AsyncIterator[Piece]], model: str, headers: dict,
                  shapers: list[Shaper], silence_s: float) -> web.Response:
    """One JSON answer: each prompt's choices collected alone (`relay.collect_body`), then put in order."""
    bodies = await all_or_none(collect_body(job, stream, model, shaper, silence_s)
                               for job, stream, shaper in zip(jobs, streams, shapers))
    answer = bodies[0]
    answer["choices"] = [{**choice, "index": position * job.request.n + choice["index"]}
                         for position, (job, body) in enumerate(zip(jobs, bodies)) for choice in body["choices"]]
    answer["usage"] = total_usage(jobs)
    return web.json_response(answer, headers=headers)


async def tagged(index: int, stream: AsyncIterator[Piece]) -> AsyncIterator[tuple[int, Piece]]:
    async for piece in stream:
        yield index, piece


async def merged(streams: list[AsyncIterator[tuple[int, Piece]]]) -> AsyncIterator[tuple[int, Piece]]:
    """The items of every stream as each comes; the first error of one ends them all."""
    iterators = [aiter(stream) for stream in streams]
    pending = {asyncio.ensure_future(anext(iterator)): iterator for iterator in iterators}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                iterator = pending.pop(task)
                with contextlib.suppress(StopAsyncIteration):
                    item = task.result()
                    yield item
                    pending[asyncio.ensure_future(anext(iterator))] = iterator
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for iterator in iterators:  # each stopped where it was, its own `finally` run now rather than at collection
            await iterator.aclose()  # type: ignore[attr-defined]


class Progress:
    """What `relay.watched` reads of a job, for the batch as a whole: its latest progress is any prompt's."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
        self.started = jobs[0].started

    @property
    def progress_at(self) -> float:
        return max(job.progress_at for job in self.jobs)


async def stream(request: web.Request, jobs: list[Job], streams: list[AsyncIterator[Piece]], model: str,
                 headers: dict, shapers: list[Shaper], silence_s: float, keepalive_s: float,
                 open_now: bool = True) -> web.StreamResponse:
    """Server-sent events of every prompt's choices as they come, each at its batch index; one usage chunk
    (the batch's) and one `[DONE]` at the end. Every prompt is placed: with `open_now` the status and headers go
    out now, else (a decode instance may still refuse one when its KV has arrived) with the first event or
    keep-alive, as a single prompt's stream does (`relay.stream`). Each prompt is timed out for silence on its own
    (`watched`); an error once the stream is open becomes an error event."""
    lead = jobs[0]
    writers = [EventWriter(job, model, shaper, offset=index * job.request.n)
               for index, (job, shaper) in enumerate(zip(jobs, shapers))]
    watchers = [tagged(index, watched(job, pieces, silence_s))
                for index, (job, pieces) in enumerate(zip(jobs, streams))]

    async def opened(at_once: bool = False) -> None:
        if lead.response is None:
            response = await writers[0].open(request, headers, at_once)
            for job in jobs:
                job.response = response

    async def keep_alive() -> None:
        await opened()
        await writers[0].keep_alive(request, headers)
    if open_now:
        await opened(at_once=True)
    progress: Any = Progress(jobs)  # what `watched` reads of a job
    events = merged(watchers)
    try:
        async for index, piece in watched(progress, events, silence_s, keepalive_s, keep_alive):
            await opened()
            await writers[index].piece(piece)
            if writers[index].held:  # a choice's last event: the lead writer sends the end alone
                await writers[0].response.write(writers[index].take())
    except ApiError as exc:
        if lead.response is None:
            raise
        await writers[0].error(exc)
        return writers[0].response
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    await writers[0].close(total_usage(jobs))
    return writers[0].response


def headers_of(headers: dict, jobs: list[Job]) -> dict[str, Any]:
    """A batch's response headers: those of its first prompt, naming every instance it ran on."""
    placements = [job.placement for job in jobs if job.placement is not None]
    for name, field in (("x-kvcentric-prefill", "prefill_id"), ("x-kvcentric-decode", "decode_id")):
        headers[name] = ",".join(dict.fromkeys(getattr(placement, field) for placement in placements))
    return headers
