"""A process that is the subreaper of its descendants gets back the children of a child that exits, reaps the
exited ones it is handed, and `end_the_rest` leaves it with no child at all. Run in a process of its own (a
subreaper's children are its own business, not pytest's)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

GRANDCHILDREN = ("import os, subprocess, sys; "
                 "quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
                 "sleeper = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'], **quiet); "
                 "done = subprocess.Popen(['true'], **quiet); "
                 "os._exit(0)")
"""A child's code: it starts a grandchild that sleeps and ignores SIGTERM and one that exits, then exits itself at
once (`os._exit`: no finalizer of its own may reap the one that exited; each `Popen` is kept in a name, since one
collected at once would poll its process in `__del__` and reap it there if it had already exited, as `true` often
has; and the grandchildren hold none of the test's pipes, so a failed assertion is reported at once, not after the
sleeper's minute)."""
SCRIPT = textwrap.dedent("""
    import signal, subprocess, sys, time
    from kvcentric.tools.processes import become_subreaper, end_the_rest, own_children, reap_zombies

    def zombie(pid):
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0] == "Z"

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # an ignored SIGCHLD (inherited) would reap the exited one at once
    assert become_subreaper()
    subprocess.run([sys.executable, "-c", GRANDCHILDREN], check=True)
    deadline = time.monotonic() + 10
    while len(own_children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    def described():
        found = []
        for pid in own_children():
            with open(f"/proc/{pid}/stat") as stat:
                found.append(stat.read()[:60])
        return found
    assert len(own_children()) == 2, f"the grandchildren did not come back to this process: {described()}"
    while not any(zombie(pid) for pid in own_children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reap_zombies(keep=set()) == 1  # `true`, exited; the sleeper stays
    (sleeper,) = own_children()
    assert not zombie(sleeper)
    started = time.monotonic()
    end_the_rest(grace_s=1.0)  # it ignores SIGTERM: SIGKILL after the grace
    assert own_children() == [], own_children()
    assert time.monotonic() - started < 5
    print("ok")
""").replace("GRANDCHILDREN", repr(GRANDCHILDREN))


def test_a_subreaper_gets_its_grandchildren_back_and_ends_them_all():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
