"""`kvcentric up` starts its own servers, serves, and on SIGTERM or SIGINT exits only once every process it started
has (its children's own children included: nothing is alive at the moment `up` has exited); with --restart never
the first death of a child stops the cluster (fail fast)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from conftest import start_up
from waiting import eventually


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead too
            return stat.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def descendants(root: int) -> list[int]:
    """Every process below `root` now (children, their children, ...), from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parents[int(entry)] = int(stat.read().rsplit(") ", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def command_line(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline") as cmdline:
        return cmdline.read().rstrip("\0").split("\0")


@pytest.mark.parametrize("sig, spawn", [(signal.SIGTERM, "fork"), (signal.SIGINT, "exec")])
def test_up_with_its_own_servers_serves_then_stops_every_child(tmp_path, sig, spawn):
    """Either way `up` starts its services (forked from itself, or each a new interpreter), they are its own
    children, show their command in `ps`, and end with it."""
    cluster = start_up(tmp_path, "--prefill", "1", "--decode", "2", "--spawn", spawn)
    try:
        assert set(cluster.manifest["services"]) >= {"nats-server", "redis-server", "kvs-meta", "conductor-0",
                                                     "conductor-1", "prefill-0", "decode-0", "decode-1", "gateway"}
        request = urllib.request.Request(cluster.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"prompt": "hi", "max_tokens": 3}).encode())
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.load(response)["usage"]["completion_tokens"] >= 1
        pids = cluster.pids()
        assert all(alive(pid) for pid in pids)
        decode = command_line(cluster.manifest["services"]["decode-1"]["pid"])
        if spawn == "fork":  # its title: its command line, as one string
            assert len(decode) == 1 and " -m kvcentric decode " in decode[0] and "--instance-id decode-1" in decode[0]
        else:
            assert decode[1:4] == ["-m", "kvcentric", "decode"] and "decode-1" in decode
        everything = descendants(cluster.process.pid)
        assert set(pids) <= set(everything) and len(everything) > len(pids)  # the engines' own children too
    finally:
        started = time.monotonic()
        assert cluster.stop(sig) == 0
    assert not [pid for pid in everything if alive(pid)], "a process outlived `kvcentric up`"
    assert time.monotonic() - started < 10
    for name, service in cluster.manifest["services"].items():
        with open(service["log"]) as log:
            assert "Traceback" not in log.read(), f"{name} logged a traceback"


def test_with_restart_never_the_first_death_stops_every_child_and_up_fails(tmp_path):
    cluster = start_up(tmp_path, "--restart", "never", "--conductors", "1")
    pids = cluster.pids()
    try:
        os.kill(cluster.manifest["services"]["decode-0"]["pid"], signal.SIGKILL)
        assert cluster.process.wait(30) == 1
    finally:
        cluster.stop()
    cluster.wait_said("kvcentric: decode-0 exited with code -9", timeout_s=5)
    eventually(lambda: [pid for pid in pids if alive(pid)], "every child of `kvcentric up` gone",
               until=lambda living: not living, timeout_s=10, every_s=0.1)
