"""A batched completion answered as one: each prompt's choices at i*n + j, usage summed, the streams merged as
their pieces come, and the first failure of one prompt ending the others (no servers: pieces made by hand)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvc_gateway import batch, relay
from kvcentric.core.openai_api import ApiError, parse_completion


def jobs_for(prompts, n: int = 1) -> list[relay.Job]:
    request = parse_completion({"prompt": prompts, "n": n, "max_tokens": 4}, "tiny", 258)
    return [relay.Job("cmpl-1", one, [256, *one.prompt.encode()], False, time.perf_counter(),
                      batch_index=index)
            for index, one in enumerate(request.each_prompt())]


async def pieces_of(job: relay.Job, texts: list[str], pause_s: float = 0.0):
    """Each choice's text as one final piece, after `pause_s`."""
    await asyncio.sleep(pause_s)
    for index, text in enumerate(texts):
        job.completion_tokens += len(text)
        yield relay.Piece(text, finish_reason="length", index=index)


def shapers(jobs):
    return [relay.Shaper(job, str, "") for job in jobs]


async def test_a_batch_answers_prompt_i_choice_j_at_index_i_n_plus_j_with_the_usage_summed():
    jobs = jobs_for(["ab", "cde"], n=2)
    streams = [pieces_of(jobs[0], ["a0", "a1"], 0.02), pieces_of(jobs[1], ["b0", "b1!"])]
    response = await batch.collect(jobs, streams, "tiny", {}, shapers(jobs), 5.0)
    body = json.loads(response.body)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1!")]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}
    assert {job.bus_id for job in jobs} == {"cmpl-1-p0", "cmpl-1-p1"} and body["id"] == "cmpl-1"


async def test_merged_streams_yield_as_items_come_and_stop_at_the_first_error():
    async def slow():
        await asyncio.sleep(0.05)
        yield "late"

    async def fast():
        yield "early"

    seen = [item async for item in batch.merged([batch.tagged(0, slow()), batch.tagged(1, fast())])]
    assert seen == [(1, "early"), (0, "late")]

    async def failing():
        yield "first"
        raise ApiError(500, "engine failed")

    never = asyncio.Event()

    async def waiting():
        await never.wait()
        yield "never"

    with pytest.raises(ApiError):
        async for _ in batch.merged([batch.tagged(0, waiting()), batch.tagged(1, failing())]):
            pass


async def test_all_or_none_cancels_the_others_when_one_fails():
    cancelled = []

    async def long():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def failing():
        raise ApiError(429, "overloaded")

    with pytest.raises(ApiError):
        await batch.all_or_none([long(), failing()])
    assert cancelled == [True]
    assert await batch.all_or_none([asyncio.sleep(0, "a"), asyncio.sleep(0, "b")]) == ["a", "b"]


class Written:
    """What an SSE response was sent (the writer's only use of it)."""

    def __init__(self) -> None:
        self.data = b""

    async def write(self, data: bytes) -> None:
        self.data += data

    async def write_eof(self, data: bytes = b"") -> None:
        self.data += data

    def events(self) -> list[dict]:
        return [json.loads(line[6:]) for line in self.data.decode().split("\n\n") if line.startswith("data: {")]


async def test_a_streamed_tool_call_goes_out_whole_in_delta_tool_calls_with_usage_on_every_chunk():
    from kvcentric.core.openai_api import parse_chat

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    request = parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [tool], "stream": True,
                          "stream_options": {"continuous_usage_stats": True}}, "tiny", 2048)
    job = relay.Job("chatcmpl-1", request, [1, 2, 3], True, time.perf_counter())
    job.response = Written()  # type: ignore[assignment]
    writer = relay.EventWriter(job, "tiny", relay.Shaper(job, str, ""))
    for text, finish in (("Sure. <tool_call>{\"name\": \"f\", ", None), ('"arguments": {"a": 1}}', None),
                         ("</tool_call>", "stop")):
        job.completion_tokens += 1
        await writer.piece(relay.Piece(text, finish_reason=finish, index=0))
    await writer.close()
    events = job.response.events()  # type: ignore[attr-defined]
    deltas = [event["choices"][0]["delta"] for event in events]
    assert deltas == [{"content": "Sure. "}, {}, {"tool_calls": [{"index": 0, "id": deltas[2]["tool_calls"][0]["id"],
                                                                 "type": "function", "function": {
                                                                     "name": "f", "arguments": '{"a": 1}'}}]}]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [event["usage"]["completion_tokens"] for event in events] == [1, 2, 3]
