"""The Supervisor restarts a child that dies, after a backoff that doubles with each quick crash in a row,
and gives up on a crash loop with a message naming the child; the restart policy is pure and tested with
time passed in."""

from __future__ import annotations

import sys
import time

import pytest

from waiting import eventually

from kvcentric.tools.processes import RestartPolicy, Supervisor


def test_the_backoff_doubles_with_quick_crashes_up_to_its_cap_and_a_long_run_starts_afresh():
    policy = RestartPolicy(first_s=0.5, most_s=4.0, fast_s=10.0, burst=5)
    streak, delays = 0, []
    for _ in range(5):
        streak = policy.fast_crashes(streak, ran_s=1.0)
        delays.append(policy.delay(streak))
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert not policy.gives_up(streak) and policy.gives_up(policy.fast_crashes(streak, ran_s=1.0))
    assert policy.fast_crashes(streak, ran_s=60.0) == 1  # it had been running well: a fresh count
    assert policy.delay(1) == 0.5


def test_a_child_that_dies_is_started_again_after_its_backoff_and_the_supervisor_says_so(tmp_path):
    marker = tmp_path / "started"
    # Each run appends a line and the first run dies with code 3; later runs live until stopped.
    script = (f"import sys, time; p = {str(marker)!r}; n = len(open(p).readlines()) if __import__('os').path"
              f".exists(p) else 0; open(p, 'a').write('x\\n'); sys.exit(3) if n == 0 else time.sleep(60)")
    supervisor = Supervisor(str(tmp_path), restarts=RestartPolicy(first_s=0.2, fast_s=10.0, burst=3))
    child = supervisor.start("worker", [sys.executable, "-c", script])
    try:
        first_pid = child.process.pid
        child.process.wait(20)
        said = supervisor.tend(time.monotonic())
        assert said == ["worker exited with code 3; restarting it in 0.2 s"]
        assert supervisor.tend(child.restart_at - 0.1) == []  # not before its backoff
        assert supervisor.tend(child.restart_at) == [f"worker restarted (pid {child.process.pid})"]
        assert child.process.pid != first_pid and child.process.poll() is None
        eventually(lambda: marker.read_text().count("x"), "the second run started", until=lambda n: n == 2)
    finally:
        supervisor.stop(grace_s=1.0)
    assert child.process.poll() is not None


def test_a_crash_loop_is_given_up_on_with_the_childs_name_and_log(tmp_path):
    supervisor = Supervisor(str(tmp_path), restarts=RestartPolicy(first_s=0.01, fast_s=60.0, burst=2))
    child = supervisor.start("looper", [sys.executable, "-c", "print('bad config'); raise SystemExit(2)"])
    said: list[str] = []
    try:
        with pytest.raises(RuntimeError) as failure:
            for _ in range(10):
                child.process.wait(10)
                said += supervisor.tend(child.started_at + 0.001)  # it died at once: a quick crash
                said += supervisor.tend(child.restart_at or 0.0)  # its backoff is over: started again
        message = str(failure.value)
        assert message.startswith("looper crashed 3 times in a row, each within 60 s of starting: giving up")
        assert "bad config" in message and "exited with code 2" in message
        assert [line for line in said if "restarting" in line] == [
            "looper exited with code 2; restarting it in 0.01 s",
            "looper exited with code 2; restarting it in 0.02 s (2 quick crashes in a row; gives up after 2)"]
    finally:
        supervisor.stop(grace_s=1.0)
