"""The decode messenger's sink when pushed KV overtakes the request's DecodeJob: the jobs go to prefill and
decode at once, so the header may come first; it waits for the job, and gives up after a while, or at once
when the request is cancelled, without leaking blocks."""

from __future__ import annotations

import asyncio
import collections
import time
import types

import pytest

from factories import decode_job, make_pool, make_runner
from waiting import eventually_async
from kvcentric.engine.service import kvsink
from kvcentric.engine.cores.decode import DecodeEngine, KVNoRoom, KVRejected
from kvcentric.engine.service.intake import JobIntake
from kvcentric.engine.service.node import Wakeup
from kvcentric.engine.service.outbox import TokenOutbox
from kvcentric.engine.service.spans import RequestSpans


def make_sink():
    """The sink, its engine, and the intake that remembers cancels (its counters are the sink's)."""
    runner = make_runner()
    engine = DecodeEngine(runner, make_pool(runner))
    intake, spans = JobIntake(collections.Counter()), RequestSpans()
    sink = kvsink.DecodeSink(engine, intake.counters, intake, spans, TokenOutbox(spans).emit, Wakeup())
    return sink, engine, intake


def header(request_id: str, engine: DecodeEngine, num_tokens: int = 4):
    return types.SimpleNamespace(request_id=request_id, dtype=engine.runner.dtype_name, num_tokens=num_tokens,
                                 num_layers=engine.runner.config.num_layers, token_ids=[1] * num_tokens, stripes=1,
                                 pool_addr="")


def test_kv_that_overtakes_its_job_waits_for_it():
    sink, engine, intake = make_sink()

    async def scenario():
        begun = asyncio.create_task(sink.begin(header("r", engine)))
        await eventually_async(lambda: "r" in sink.waiting, "the KV waits for its job")
        assert not begun.done()  # held: no job yet
        engine.add(decode_job("r", 4), time.monotonic())
        sink.registered("r")
        await asyncio.wait_for(begun, 1.0)

    asyncio.run(scenario())
    assert engine.requests["r"].state == "receiving"
    assert intake.counters["kv_before_job_total"] == 1 and not sink.waiting


def test_kv_whose_job_never_comes_is_refused_without_taking_blocks(monkeypatch):
    monkeypatch.setattr(kvsink, "JOB_WAIT_S", 0.05)
    sink, engine, _ = make_sink()
    with pytest.raises(KVRejected, match="not expected"):
        asyncio.run(sink.begin(header("ghost", engine)))
    assert engine.pool.num_free == engine.pool.num_blocks and not sink.waiting


def test_kv_for_a_known_job_begins_at_once():
    sink, engine, intake = make_sink()
    engine.add(decode_job("r", 4), time.monotonic())
    asyncio.run(asyncio.wait_for(sink.begin(header("r", engine)), 0.5))
    assert engine.requests["r"].state == "receiving" and intake.counters["kv_before_job_total"] == 0


def test_kv_waiting_for_a_job_gives_up_at_once_when_the_request_is_cancelled():
    """The decode refused the job (or never got it) and the request is cancelled: the prefill pushing the KV
    must not wait JOB_WAIT_S (5 s) for the refusal, holding up every prompt queued behind it."""
    sink, engine, intake = make_sink()

    async def scenario():
        begun = asyncio.create_task(sink.begin(header("r", engine)))
        await eventually_async(lambda: "r" in sink.waiting, "the KV waits for its job")
        assert not begun.done()
        intake.cancel("r")  # what the intake does with a Cancel, before the role's handler
        sink.cancelled("r")
        with pytest.raises(KVRejected, match="cancelled"):
            await asyncio.wait_for(begun, 0.5)
        with pytest.raises(KVRejected, match="cancelled"):  # KV that comes after the cancel is refused at once
            await asyncio.wait_for(sink.begin(header("r", engine)), 0.5)

    asyncio.run(scenario())
    assert engine.pool.num_free == engine.pool.num_blocks and not sink.waiting and "r" not in engine.requests


def test_kv_with_no_room_waits_for_room_and_begins_once_a_step_freed_blocks(monkeypatch):
    """A computed prompt is not refused for a full cache at once: its push waits while steps free blocks."""
    monkeypatch.setattr(kvsink, "ROOM_WAIT_S", 10.0)
    runner = make_runner(num_blocks=4)
    engine = DecodeEngine(runner, make_pool(runner))  # no host staging
    sink = kvsink.DecodeSink(engine, collections.Counter(), set(), RequestSpans(), lambda chunks: None, Wakeup())
    held = engine.pool.allocate(3)  # what the requests running there hold
    engine.add(decode_job("r", 7), time.monotonic())  # 7 tokens + 1 need 2 blocks of 4; 1 is free

    async def scenario():
        begun = asyncio.create_task(sink.begin(header("r", engine, num_tokens=7)))
        await eventually_async(lambda: sink.counters["kv_room_waits_total"], "the KV waits for room")
        assert not begun.done() and engine.requests["r"].state == "waiting_kv"
        engine.pool.free(held)  # a step ended the running requests
        sink.freed()
        await asyncio.wait_for(begun, 2.0)
    asyncio.run(scenario())
    assert engine.requests["r"].state == "receiving" and sink.counters["kv_room_waits_total"] == 1


def test_kv_with_no_room_on_the_device_or_in_staging_ends_its_request_with_a_429(monkeypatch):
    monkeypatch.setattr(kvsink, "ROOM_WAIT_S", 0.2)  # none freed meanwhile
    runner = make_runner(num_blocks=2)
    engine = DecodeEngine(runner, make_pool(runner))  # no host staging
    emitted: list = []
    sink = kvsink.DecodeSink(engine, collections.Counter(), set(), RequestSpans(), emitted.extend, Wakeup())
    engine.add(decode_job("big", 12), time.monotonic())  # 12 tokens + 1 need 4 blocks of 4
    with pytest.raises(KVNoRoom, match="decode instance full"):
        asyncio.run(sink.begin(header("big", engine, num_tokens=12)))
    assert [(c.finish_reason, c.error_status) for c in emitted] == [("error", 429)]
    assert "big" not in engine.requests and engine.pool.num_free == engine.pool.num_blocks
    sink.abort("big", "push did not complete")  # the servicer's abort after the refusal finds nothing left
    assert emitted[1:] == [None]
