"""KVSGate, the kvs-meta health gate: marked down after retry_times failures in a row, not asked for
down_duration_s, asked again afterwards. Time is passed in; no servers."""

from __future__ import annotations

import pytest

from kvcentric.core.scheduling.kvs_gate import KVSGate


def fail(gate: KVSGate, times: int, now: float = 0.0) -> list[bool]:
    return [gate.on_failure(now) for _ in range(times)]


def test_a_fresh_gate_is_available_at_any_time():
    gate = KVSGate()
    assert gate.available(0.0) and gate.available(-1e9) and not gate.is_down(0.0)
    assert gate.times_marked_down == 0 and gate.consecutive_failures == 0


def test_the_settings_are_kept():
    gate = KVSGate(retry_times=4, retry_interval_s=0.25, down_duration_s=7.0)
    assert (gate.retry_times, gate.retry_interval_s, gate.down_duration_s) == (4, 0.25, 7.0)


@pytest.mark.parametrize("retry_times", [0, -1])
def test_fewer_than_one_try_is_refused(retry_times):
    with pytest.raises(ValueError, match="retry_times"):
        KVSGate(retry_times=retry_times)


def test_it_is_marked_down_by_the_nth_consecutive_failure_and_not_before():
    gate = KVSGate(retry_times=3, down_duration_s=10.0)
    assert fail(gate, 2, now=5.0) == [False, False]
    assert gate.available(5.0) and gate.consecutive_failures == 2 and gate.times_marked_down == 0
    assert gate.on_failure(5.0) is True
    assert gate.is_down(5.0) and not gate.available(5.0) and gate.times_marked_down == 1


def test_a_single_try_marks_it_down_at_once():
    gate = KVSGate(retry_times=1, down_duration_s=1.0)
    assert gate.on_failure(0.0) is True and gate.is_down(0.5)


def test_a_success_resets_the_count():
    gate = KVSGate(retry_times=3)
    fail(gate, 2)
    gate.on_success()
    assert gate.consecutive_failures == 0
    assert fail(gate, 2) == [False, False]  # two more are not three in a row
    assert gate.available(0.0) and gate.times_marked_down == 0
    assert gate.on_failure(0.0) is True


def test_it_is_unavailable_for_the_down_duration_then_available_again():
    gate = KVSGate(retry_times=2, down_duration_s=30.0)
    fail(gate, 2, now=100.0)
    for now in (100.0, 110.0, 129.999):
        assert not gate.available(now) and gate.is_down(now)
    assert gate.available(130.0) and not gate.is_down(130.0)  # the period ends exactly at now + duration
    assert gate.available(1000.0)


def test_the_down_period_counts_from_the_failure_that_marked_it():
    gate = KVSGate(retry_times=2, down_duration_s=10.0)
    gate.on_failure(0.0)
    gate.on_failure(7.0)
    assert not gate.available(16.9) and gate.available(17.0)


def test_after_a_down_period_it_takes_retry_times_new_failures_to_mark_it_down_again():
    gate = KVSGate(retry_times=3, down_duration_s=10.0)
    fail(gate, 3, now=0.0)
    assert gate.consecutive_failures == 0  # the count starts over once it is marked down
    assert fail(gate, 2, now=10.0) == [False, False]
    assert gate.available(10.0) and gate.times_marked_down == 1
    assert gate.on_failure(10.0) is True
    assert not gate.available(19.0) and gate.available(20.0)
    assert gate.times_marked_down == 2


def test_times_marked_down_counts_every_down_period():
    gate = KVSGate(retry_times=2, down_duration_s=1.0)
    for period in range(5):
        now = 10.0 * period
        assert fail(gate, 2, now) == [False, True]
        assert gate.is_down(now) and gate.available(now + 1.0)
    assert gate.times_marked_down == 5


def test_a_success_after_recovery_keeps_it_available():
    gate = KVSGate(retry_times=2, down_duration_s=5.0)
    fail(gate, 2, now=0.0)
    gate.on_success()  # kvs-meta answered the first query after the down period
    assert gate.available(5.0) and gate.consecutive_failures == 0
    assert gate.on_failure(6.0) is False and gate.available(6.0)
