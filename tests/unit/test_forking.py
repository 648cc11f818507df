"""`kvcentric up --spawn fork`'s children (`kvcentric.tools.forking`): a forked `python -m kvcentric ...` exits as
the interpreter would, writes only to its log, never comes back into its parent's code, and is waited like a
Popen."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvcentric.tools import forking
from kvcentric.tools.processes import _die_with_parent


def kvcentric(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvcentric", *args]


def forked(tmp_path, *args: str) -> tuple[forking.Forked, str]:
    log = tmp_path / "child.log"
    with open(log, "ab") as out:
        child = forking.fork_command(kvcentric(*args), out.fileno(), _die_with_parent)
    assert os.getpid() != child.pid  # (a child that came back here would fail this test twice over)
    child.wait(60)
    return child, log.read_text()


def test_only_a_python_m_kvcentric_command_of_this_python_is_forked():
    assert forking.forks(kvcentric("gateway", "--port", "0"))
    assert not forking.forks(kvcentric())
    assert not forking.forks(["/usr/bin/python3", "-m", "kvcentric", "gateway"])
    assert not forking.forks(["nats-server", "-p", "-1"])


def test_a_forked_command_prints_to_its_log_and_exits_as_the_interpreter_would(tmp_path):
    child, log = forked(tmp_path, "--help")
    assert child.returncode == 0 and "usage: kvcentric" in log
    child, log = forked(tmp_path, "gateway", "--no-such-flag")
    assert child.returncode == 2 and "unrecognized arguments: --no-such-flag" in log
    assert child.poll() == 2


def test_the_same_command_started_as_an_interpreter_says_the_same(tmp_path):
    run = subprocess.run(kvcentric("gateway", "--no-such-flag"), capture_output=True, text=True, timeout=60)
    _, log = forked(tmp_path, "gateway", "--no-such-flag")
    assert run.returncode == 2 and run.stderr.splitlines()[-1] == log.splitlines()[-1]


def test_a_forked_child_is_waited_like_a_popen():
    pid = os.fork()
    if pid == 0:  # a child that waits to be killed
        time.sleep(60)
        os._exit(0)
    child = forking.Forked(pid, ["sleeper"])
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.05)
    child.send_signal(signal.SIGKILL)
    assert child.wait(10) == -signal.SIGKILL and child.returncode == -signal.SIGKILL
    child.kill()  # a child already waited for: nothing happens
    assert child.poll() == -signal.SIGKILL


def test_exit_codes_are_the_interpreters():
    assert forking._exit_code(SystemExit()) == 0
    assert forking._exit_code(SystemExit(3)) == 3
    assert forking._exit_code(SystemExit("kvcentric: bad flag")) == 1
