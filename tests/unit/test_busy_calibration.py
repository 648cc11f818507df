"""A calibration timed while the machine was busy (issue 48): `cpuwatch` tells a busy stretch from a quiet one,
the speed meter reports the parts it timed then as a guess, and a later calibration (quiet, or agreeing with the
one before) or enough steps served replace it; `--slow-step-s` slows timed calls while a file exists."""

from __future__ import annotations

import time

import pytest

from factories import make_pool, make_runner
from kvcentric.engine.service import speed as speed_module
from kvcentric.engine.service.cpuwatch import CpuWatch, Sample, Stretch, judge
from kvcentric.engine.service.speed import SERVED_TO_MEASURE, SpeedMeter


def test_other_processes_on_the_cores_left_to_them_are_not_busy_but_beyond_them_they_are():
    start = Sample(0.0, 0.0, 0.0)
    # 2 cores, 1 thread of ours fully used; others use 0.9 core: the core we left them, within the slack
    assert not judge(start, Sample(1.0, 1.9, 1.0), cores=2, threads=1).busy
    crowded = judge(start, Sample(1.0, 2.0 + 0.5, 0.5), cores=2, threads=2)  # others took 2 cores' worth less ours
    assert crowded.busy and crowded.others_cores == pytest.approx(2.0)


def test_a_process_that_got_a_fraction_of_the_cpu_it_asked_for_was_busy():
    start = Sample(0.0, 0.0, 0.0)
    held_up = judge(start, Sample(1.0, 0.6, 0.6), cores=2, threads=2)  # 0.6 of the 2 core-seconds it asked for
    assert held_up.busy and held_up.own_share == pytest.approx(0.3)
    assert not judge(start, Sample(1.0, 0.6, 0.6), cores=2, threads=2, check_own=False).busy  # a GPU's wait
    assert not judge(None, None, 2, 2).busy  # nothing seen: quiet


def test_a_sleep_in_the_watched_stretch_reads_as_busy():
    watch = CpuWatch(cores=2)
    time.sleep(0.3)
    stretch = watch.stretch(threads=1)
    assert stretch.busy and stretch.own_share < 0.5 and "busy" in stretch.describe()


class Machine:
    """Stands in for `CpuWatch`: each calibration sees the machine as `busy` says now."""

    busy = True

    def __init__(self, cores=None, check_own=True) -> None:
        pass

    def stretch(self, threads: int) -> Stretch:
        return Stretch(1.0, 1.5 if Machine.busy else 0.0, 1.0, Machine.busy)


@pytest.fixture
def meter(monkeypatch):
    monkeypatch.setattr(speed_module, "CpuWatch", Machine)
    runner = make_runner(num_blocks=256, block_size=16)
    return SpeedMeter(runner, "tiny", 64), make_pool(runner)


def calibrate(meter, busy: bool) -> None:
    Machine.busy = busy
    speed, pool = meter
    speed.calibrate(pool, True, True, 4)


def test_a_busy_calibration_is_a_guess_and_a_quiet_one_replaces_it(meter):
    speed, _ = meter
    calibrate(meter, busy=True)
    assert speed.measured().guess == ["decode", "prefill"]
    guessed = list(speed.guessed["decode"])
    calibrate(meter, busy=False)
    assert speed.measured().guess == [] and not speed.guessed["decode"]
    held = {tuple(row) for row in speed.fit.decode.window.rows()}
    assert not held & set(guessed)  # the busy samples are gone from the fit


def test_a_busy_calibration_that_agrees_with_the_one_before_is_steady_until_a_quiet_one(meter, monkeypatch):
    speed, _ = meter
    calibrate(meter, busy=True)
    monkeypatch.setattr(speed, "agrees", lambda *args: True)
    calibrate(meter, busy=True)
    assert speed.measured().guess == [] and speed.steady == {"prefill", "decode"} == speed.unsettled  # trusted
    monkeypatch.setattr(speed, "agrees", lambda *args: False)
    calibrate(meter, busy=True)  # the machine's load changed: a guess again
    assert speed.guess == {"prefill", "decode"} and not speed.steady
    calibrate(meter, busy=False)
    assert not speed.unsettled


def test_a_busy_calibration_that_disagrees_stays_a_guess_with_its_own_samples(meter, monkeypatch):
    speed, _ = meter
    calibrate(meter, busy=True)
    first = list(speed.guessed["prefill"])
    monkeypatch.setattr(speed, "agrees", lambda *args: False)
    calibrate(meter, busy=True)
    assert "prefill" in speed.guess and speed.guessed["prefill"] and speed.guessed["prefill"] != first
    assert not {tuple(row) for row in speed.fit.prefill.window.rows()} & set(first)


def test_timings_agree_when_the_fit_before_them_predicted_them(meter):
    speed, _ = meter
    calibrate(meter, busy=True)
    fit = speed.fit.decode.fit
    samples = [(b, k, speed.fit.decode.predict(b, k, fit)) for b, k in ((1, 65), (4, 260))]
    assert speed.agrees("decode", samples, fit)
    assert not speed.agrees("decode", [(b, k, 3 * s) for b, k, s in samples], fit)
    assert not speed.agrees("decode", samples, None)
    earlier = [(1, 65, 0.1), (1, 65, 0.12), (4, 260, 0.3)]  # shape by shape, where the earlier one timed it
    assert speed.agrees("decode", [(1, 65, 0.11), (4, 260, 0.33)], None, earlier)
    assert not speed.agrees("decode", [(1, 65, 0.2), (4, 260, 0.6)], fit, earlier)


def test_steps_served_replace_a_guess(meter):
    speed, _ = meter
    calibrate(meter, busy=True)
    for step in range(SERVED_TO_MEASURE):
        assert "decode" in speed.guess, step
        speed.decode(2, 100, 0.01)
    assert "decode" not in speed.guess and "prefill" in speed.guess


def test_slow_steps_apply_while_the_file_exists(tmp_path):
    runner = make_runner()
    switch = tmp_path / "slow"
    speed = SpeedMeter(runner, "tiny", 64, slow_step_s=0.2, slow_while_file=str(switch))
    switch.touch()
    assert speed.timed(lambda: None)[1] >= 0.2
    switch.unlink()
    assert speed.timed(lambda: None)[1] < 0.2
