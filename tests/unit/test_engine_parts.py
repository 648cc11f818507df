"""The small parts the engine services are made of, on their own: the intake's refusals and its memory of
cancels, the outbox's order and span closing, the role change's answers and drain, the load report."""

from __future__ import annotations

import asyncio
import collections
import logging

import pytest

from factories import decode_job, make_pool, make_runner
from kvcentric.core.protocol import RoleSwitch, SamplingParams, TokenChunk
from kvcentric.engine.service import intake as intake_module
from kvcentric.engine.service import roles
from kvcentric.engine.service.intake import JobIntake
from kvcentric.engine.service.node import Wakeup
from kvcentric.engine.service.outbox import TokenOutbox
from kvcentric.engine.service.reporter import Load, Reporter
from kvcentric.engine.service.roles import RoleChange
from kvcentric.engine.service.spans import RequestSpans
from kvcentric.runtime.tasks import Tasks
from kvcentric.runtime.transfer import KVPusher


# ---------------------------------------------------------------- intake


def test_a_job_is_refused_when_its_request_was_cancelled_before_it_came():
    intake = JobIntake(collections.Counter())
    assert intake.refusal(decode_job("r", 4)) is None
    intake.cancel("r")
    ack = intake.refusal(decode_job("r", 4))
    assert not ack.ok and "cancelled before its job arrived" in ack.error
    assert intake.counters["jobs_after_cancel_total"] == 1


def test_a_malformed_job_is_refused_and_counted_as_a_drop():
    intake = JobIntake(collections.Counter())
    ack = intake.refusal(decode_job("no spaces allowed", 4))
    assert not ack.ok and "request_id" in ack.error and intake.counters["bus_drops_total"] == 1
    zero = decode_job("r", 4, SamplingParams(max_tokens=0))
    assert not intake.refusal(zero).ok


def test_the_intake_remembers_only_the_latest_cancels(monkeypatch):
    monkeypatch.setattr(intake_module, "CANCELLED_REMEMBERED", 2)
    intake = JobIntake(collections.Counter())
    for request_id in ("a", "b", "c"):
        intake.cancel(request_id)
    assert "a" not in intake and "b" in intake and "c" in intake


# ---------------------------------------------------------------- outbox and wake-up


def test_the_outbox_keeps_order_skips_nothing_to_send_and_closes_finished_requests_spans():
    spans = RequestSpans()
    outbox = TokenOutbox(spans)
    spans.start("r", "decode.generate")
    last = TokenChunk(request_id="r", seq=1, token_ids=[6], finish_reason="length", prompt_tokens=4,
                      completion_tokens=2)
    outbox.emit([TokenChunk(request_id="r", seq=0, token_ids=[5]), None, last])
    sent = [outbox.queue.get_nowait() for _ in range(outbox.queue.qsize())]
    assert [c.token_ids for c in sent] == [[5], [6]] and outbox.empty()
    assert ("r", "decode.generate") not in spans.open


def test_the_work_loop_wakes_when_set_and_sleeps_out_its_timeout_otherwise():
    async def scenario() -> tuple[float, float]:
        wake = Wakeup()
        loop = asyncio.get_running_loop()
        started = loop.time()
        await wake.sleep(0.05)
        slept = loop.time() - started
        wake.set()
        started = loop.time()
        await wake.sleep(5.0)
        return slept, loop.time() - started

    slept, woken = asyncio.run(scenario())
    assert slept >= 0.04 and woken < 1.0


# ---------------------------------------------------------------- role change


def role_change(role: str, idle=lambda: True, events: list | None = None) -> RoleChange:
    events = [] if events is None else events

    async def report_load() -> None:
        events.append("load")

    async def forget_cache() -> None:
        events.append("forget")

    return RoleChange(role, Tasks(logging.getLogger("test")), collections.Counter(), logging.getLogger("test"),
                      idle, report_load, forget_cache)


def test_a_colocated_instance_refuses_to_switch_and_a_switch_to_its_own_role_is_a_no_op():
    assert not role_change("colocated").answer(RoleSwitch(role="decode")).ok
    ack = role_change("prefill").answer(RoleSwitch(role="prefill"))
    assert ack.ok and "already a prefill" in ack.error
    assert role_change("prefill").answer(RoleSwitch(role="decode")) is None


def test_a_switch_reports_draining_at_once_then_drains_forgets_the_cache_and_stops(monkeypatch):
    monkeypatch.setattr(roles, "DRAIN_GRACE_S", 0.0)
    events: list[str] = []
    change = role_change("prefill", events=events)

    async def scenario() -> None:
        ack = await change.on_switch(RoleSwitch(role="decode", reason="replan"))
        assert ack.ok and change.draining and events == ["load"]
        again = await change.on_switch(RoleSwitch(role="prefill"))
        assert not again.ok and "already draining to decode" in again.error
        await asyncio.wait_for(change.tasks.stopping.wait(), 1.0)

    asyncio.run(scenario())
    assert events == ["load", "forget"] and change.next_role == "decode"
    assert change.counters["role_switches_total"] == 1


# ---------------------------------------------------------------- load report


def test_the_load_report_carries_the_roles_numbers_and_the_pool_and_drain_state():
    runner = make_runner()
    pool = make_pool(runner)
    reporter = Reporter(None, "p0", "dc1", pool, None, KVPusher())
    report = reporter.load_report("prefill", Load(2, 300, 1), "127.0.0.1:5000", draining=True)
    assert (report.instance_id, report.role, report.cluster, report.kv_addr) == ("p0", "prefill", "dc1",
                                                                                "127.0.0.1:5000")
    assert (report.queued_requests, report.queued_tokens, report.running, report.draining) == (2, 300, 1, True)
    assert (report.kv_blocks_total, report.kv_blocks_free) == (pool.num_blocks, pool.num_free)
    assert reporter.stats()["kv_blocks_total"] == pool.num_blocks



def test_a_prefill_report_carries_its_queue_time_from_the_measured_model_and_its_uncached_tokens():
    from kvcentric.core.scheduling.queueing import QueuedPrefill
    from kvcentric.engine.service.speed import SpeedMeter
    runner = make_runner()
    reporter = Reporter(None, "p0", "dc1", make_pool(runner), None, KVPusher())
    reporter.speed = SpeedMeter(runner, "tiny", prefill_chunk=10_000)
    prefills = (QueuedPrefill("a", 300, 100), QueuedPrefill("b", 200, 0))
    before = reporter.load_report("prefill", Load(1, 500, 1, prefills=prefills), "a:1", draining=False)
    assert (before.est_queue_s, before.queued_uncached_tokens, before.prefill_ids) == (-1.0, 400, ["a", "b"])
    for n_new in (50, 100, 200, 400, 50, 100, 200, 400):  # 0.01 s + 1 ms per token, no prefix
        reporter.speed.prefill(n_new, 0, 0.01 + 0.001 * n_new)
    reporter.speed.fit.refit()
    report = reporter.load_report("prefill", Load(1, 500, 1, prefills=prefills), "a:1", draining=False)
    assert report.est_queue_s == pytest.approx(0.01 + 0.2 + 0.01 + 0.2, rel=0.02)
    decode = reporter.load_report("decode", Load(1, 500, 1, prefills=prefills), "a:1", draining=False)
    assert (decode.est_queue_s, decode.prefill_ids) == (-1.0, None)
    # every prefill report, the cost model in it or not, carries the latest chunk timed and its number
    assert (before.last_prefill, before.prefill_samples) == ([], 0)
    reporter.speed.prefill(300, 100, 0.5)
    after = [reporter.load_report("prefill", Load(1, 500, 1, prefills=prefills), "a:1", draining=False)
             for _ in range(3)]
    assert [(r.last_prefill, r.prefill_samples) for r in after] == [([300.0, 100.0, 0.5], 9)] * 3
    assert any(r.cost is None for r in after) and (decode.last_prefill, decode.prefill_samples) == ([], 0)



class _Bus:
    """Records what is published (a stand-in for the NATS bus in this pure test)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    async def publish(self, subject: str, message) -> None:
        self.sent.append((subject, message))


async def test_an_engine_is_ready_once_its_first_load_report_is_out_and_not_while_draining():
    runner = make_runner()
    bus = _Bus()
    reporter = Reporter(bus, "p0", "dc1", make_pool(runner), None, KVPusher())
    assert "load report" in reporter.readiness(draining=False)
    await reporter.publish_load("prefill", Load(0, 0, 0), "127.0.0.1:5000")
    assert len(bus.sent) == 1 and reporter.readiness(draining=False) == ""
    assert "draining" in reporter.readiness(draining=True)
