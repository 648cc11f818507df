"""Busy is not dead: the conductor takes a repeated load report as liveness only, counts lost heartbeats
and drops an instance whose loop is stuck; the reporter repeats the last load while its loop is busy."""

import asyncio
import concurrent.futures
import time

import msgspec
import pytest

from factories import decode_report, load_report, make_conductor, schedule_request
from kvcentric.core.protocol import Placement, Rejection
from kvcentric.engine.service.reporter import Load, Reporter
from kvcentric.core.block_pool import BlockPool
from kvcentric.runtime.transfer import KVPusher


def beat(report, seq: int, repeat: bool = False, load_age_s: float = 0.0):
    return msgspec.structs.replace(report, seq=seq, repeat=repeat, load_age_s=load_age_s)


def test_a_repeated_report_keeps_a_busy_prefill_alive_and_keeps_what_was_placed_there():
    conductor = make_conductor(0, 1)
    report = load_report("p0", "prefill")
    conductor.observe(beat(report, 1), 0.0)
    conductor.schedule(schedule_request(3000), {}, 0.0)
    for seq, now in enumerate((1.0, 2.0, 3.0), start=2):  # its loop is busy: only repeats come
        conductor.observe(beat(report, seq, repeat=True, load_age_s=now), now)
        conductor.observe(decode_report("d0"), now)
    state = conductor.registry.prefill["p0"]
    assert state.load_tokens == 3000  # not reset by the repeats: it stays ranked by what it holds
    assert isinstance(conductor.schedule(schedule_request(100, "b"), {}, 3.5), Placement)
    assert [i.busy_s for i in conductor.registry.snapshot(3.5) if i.role == "prefill"] == [3.0]
    assert conductor.registry.repeats == 3


def test_a_prefill_whose_heartbeats_stop_is_dead():
    conductor = make_conductor(0, 1)
    conductor.observe(beat(load_report("p0", "prefill"), 1), 0.0)
    conductor.observe(decode_report("d0"), 2.0)
    decision = conductor.schedule(schedule_request(), {}, 2.0)
    assert isinstance(decision, Rejection) and "no prefill instance is alive" in decision.message


def test_an_instance_whose_loop_computed_no_load_for_stuck_after_s_is_out_of_placement():
    conductor = make_conductor(0, 1)
    conductor.registry.stuck_after_s = 30.0
    conductor.observe(beat(load_report("p0", "prefill"), 40, repeat=True, load_age_s=31.0), 0.0)
    assert conductor.registry.alive_prefill(0.1) == []
    conductor.observe(beat(load_report("p0", "prefill"), 41), 0.2)
    assert [s.instance_id for s in conductor.registry.alive_prefill(0.3)] == ["p0"]


def test_gaps_in_the_heartbeat_sequence_are_counted_and_a_restart_is_not_a_gap():
    conductor = make_conductor(0, 0)
    report = load_report("d9", "decode")
    for seq in (1, 2, 5, 6, 1, 2):
        conductor.observe(beat(report, seq), 0.0)
    assert conductor.registry.missed_beats == 2


def reporter(every_s: float = 0.2) -> Reporter:
    return Reporter(None, "p0", "dc1", BlockPool(8, 16), None, KVPusher(), heartbeat_every_s=every_s)


def test_the_heartbeat_sends_a_new_load_once_then_repeats_it_while_the_loop_is_busy():
    reporter_ = reporter()
    reporter_.latest["prefill"] = (reporter_.load_report("prefill", Load(1, 50, 1), "a:1", False), 10.0)
    [(subject, first)] = reporter_.due_reports(10.0)
    assert subject == "kvc.load.prefill.p0" and (first.seq, first.repeat, first.queued_tokens) == (1, False, 50)
    assert reporter_.due_reports(10.1) == []  # sent 0.1 s ago: nothing new, not due again
    [(_, again)] = reporter_.due_reports(10.25)
    assert (again.seq, again.repeat, again.load_age_s) == (2, True, pytest.approx(0.25))
    reporter_.latest["prefill"] = (reporter_.load_report("prefill", Load(0, 0, 0), "a:1", False), 10.3)
    [(_, fresh)] = reporter_.due_reports(10.3)
    assert (fresh.seq, fresh.repeat, fresh.queued_tokens) == (3, False, 0)
    assert reporter_.reports_sent == 3


class CountedBeats:
    """The heartbeat's `beat` as the event loop calls it: done at once, counted."""

    def __init__(self) -> None:
        self.beats = 0

    def beat(self) -> concurrent.futures.Future:
        self.beats += 1
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(None)
        return done


def test_an_unchanged_load_is_left_to_the_heartbeat_which_repeats_it_with_its_age_from_the_last_look():
    reporter_ = reporter()
    heartbeat = reporter_.heartbeat = CountedBeats()
    asyncio.run(reporter_.publish_load("prefill", Load(0, 0, 0), "a:1"))
    [(_, first)] = reporter_.due_reports(time.monotonic())
    assert (heartbeat.beats, first.repeat) == (1, False)
    time.sleep(0.05)
    looked = time.monotonic()
    asyncio.run(reporter_.publish_load("prefill", Load(0, 0, 0), "a:1"))  # the same numbers, a later `ts`
    assert (heartbeat.beats, reporter_.unchanged_reports) == (1, 1)  # nobody woken for it
    assert reporter_.due_reports(looked + 0.1) == []
    [(_, again)] = reporter_.due_reports(looked + 0.25)
    assert again.repeat and again.load_age_s == pytest.approx(0.25, abs=0.02)  # not 0.30: vouched for at `looked`
    asyncio.run(reporter_.publish_load("prefill", Load(1, 50, 1), "a:1"))  # new numbers go at once
    [(_, fresh)] = reporter_.due_reports(time.monotonic())
    assert (heartbeat.beats, fresh.repeat, fresh.queued_tokens) == (2, False, 50)


def test_a_colocated_instances_two_roles_share_each_tick_number():
    reporter_ = reporter()
    for role in ("prefill", "decode"):
        reporter_.latest[role] = (reporter_.load_report(role, Load(0, 0, 0), "a:1", False), 0.0)
    reports = reporter_.due_reports(0.0)
    assert sorted(s for s, _ in reports) == ["kvc.load.decode.p0", "kvc.load.prefill.p0"]
    assert {r.seq for _, r in reports} == {1}


def test_a_repeat_teaches_the_conductor_nothing_about_links():
    conductor = make_conductor(0, 1)
    report = msgspec.structs.replace(load_report("p0", "prefill"), link_bandwidth={"peer:1": 5e9})
    conductor.observe(beat(report, 1, repeat=True), 0.0)
    assert conductor.links.bytes_per_s("p0", "peer:1") != 5e9
    conductor.observe(beat(report, 2), 0.1)
    assert conductor.links.bytes_per_s("p0", "peer:1") == 5e9
