"""The fault-injection scenarios of issue 15 on a real `kvcentric up` cluster (2 prefill, 2 decode, 2
conductors, kvs-meta, nats-server, redis-server): each runs steady streaming load, injects one fault, and
returns its `Figures` with the answers behind anything that went wrong; the test asserts on them and
bench/serving/faults.py tabulates them. Nothing here is mocked: faults are signals to real processes.

Faults: `kill -9` of a child (up starts it again), SIGSTOP then SIGCONT, nats-server and redis-server
killed and restarted by up, one decode made a slow receiver (stopped most of every 0.1 s), and open-loop
arrivals at 3x the rate the cluster sustains. The bound a request may wait with nothing arriving is the
fault's detection time (how long until the cluster can tell) plus GRACE_S.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import tempfile
import time
import urllib.parse
from collections.abc import Iterator

from harness import UpProcess
from load import Answer, Figures, Load, figures, refusal_reasons
from waiting import eventually

from kvcentric.tools.processes import get_json, wait_for_port

ENGINES = ("prefill-0", "prefill-1", "decode-0", "decode-1")
CONDUCTORS = ("conductor-0", "conductor-1")
STALE_AFTER_S = 1.5
"""The conductor's --stale-after-s (its default): an engine or kvs-meta that stops reporting is dead after this."""
BUS_TIMEOUT_S = 5.0
"""The gateway's --bus-timeout-s (its default): a conductor holding a request silently is given up on after this."""
GRACE_S = 5.0
"""Issue 15: no request waits longer than detection + this, and the cluster serves normally this long after
the fault's end."""
CLIENTS = 4
"""Closed-loop streaming clients of the steady load."""
TTFT_SLO_S = 2.0
"""The conductors' --ttft-slo-s: overload must be refused, not queued past the bound (the default, 30 s, is
above every bound here)."""
RUN_OF_SUCCESSES = 2 * CLIENTS
"""Successes in a row after the fault's end that show the cluster serving normally again (the load then stops)."""
TAIL_S = 2.0
"""The load runs at most GRACE_S + this after the fault's end."""
START_TIMEOUT_S = 240.0
"""How long the cluster may take to start (four engines importing torch at once on a busy 2-core box)."""
WHOLE_TIMEOUT_S = 120.0
"""How long a restarted child may take to be back (torch import and calibration on a busy 2-core box)."""
BLOCK_SIZE = 16
"""Tokens per KV block (up's --block-size default)."""
SETTLE_S = 15.0
"""How long the engines may take to free every KV block once the load has stopped."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One scenario: `action` done to the child `target`: cluster.json's name, or `prefill` / `decode` for
    the instance of that role that serves the most of the load's requests at the time."""

    name: str
    target: str
    action: str
    """kill (SIGKILL; up restarts it), stop (SIGSTOP for `stop_s`, then SIGCONT), restart (SIGKILL of a server;
    its end is when up has it back), throttle (a slow receiver), overload (3x the sustainable rate)."""
    detection_s: float

    @property
    def bound_s(self) -> float:
        return self.detection_s + GRACE_S

    @property
    def stop_s(self) -> float:
        """A stop outlasts the bound, so that a request left waiting on the stopped process would show."""
        return self.bound_s + 1.5


FAULTS = (
    Fault("decode: kill -9", "decode", "kill", STALE_AFTER_S),
    Fault("decode: SIGSTOP", "decode", "stop", STALE_AFTER_S),
    Fault("prefill: kill -9", "prefill", "kill", STALE_AFTER_S),
    Fault("prefill: SIGSTOP", "prefill", "stop", STALE_AFTER_S),
    Fault("conductor: kill -9", "conductor-0", "kill", BUS_TIMEOUT_S),
    Fault("conductor: SIGSTOP", "conductor-1", "stop", BUS_TIMEOUT_S),
    Fault("kvs-meta: kill -9", "kvs-meta", "kill", STALE_AFTER_S),
    Fault("kvs-meta: SIGSTOP", "kvs-meta", "stop", STALE_AFTER_S),
    Fault("nats-server: restarted", "nats-server", "restart", STALE_AFTER_S),
    Fault("redis-server: restarted", "redis-server", "restart", STALE_AFTER_S),
    Fault("decode: slow receiver", "decode", "throttle", STALE_AFTER_S),
    Fault("3x overload", "gateway", "overload", STALE_AFTER_S),
)
THROTTLE_S = 6.0
"""How long the slow receiver stays slow."""
THROTTLE_PERIOD_S, THROTTLE_RUNNING = 0.1, 0.2
"""The slow receiver runs for this share of every period and is stopped for the rest."""
CAPACITY_CLIENTS, CAPACITY_S, OVERLOAD_FACTOR, OVERLOAD_S = 16, 4.0, 3.0, 6.0
"""Overload: the sustainable rate (requests completed per second with this many closed-loop clients, over
CAPACITY_S), then arrivals at OVERLOAD_FACTOR times it for OVERLOAD_S on top of the steady load."""


@contextlib.contextmanager
def cluster(log_dir: str | None = None) -> Iterator[UpProcess]:
    """The scenarios' cluster, stopped at the end."""
    up = UpProcess(log_dir or tempfile.mkdtemp(prefix="kvc-faults-"), "--prefill", "2", "--decode", "2",
                   "--conductors", "2", timeout_s=START_TIMEOUT_S, env={"KVC_TTFT_SLO_S": str(TTFT_SLO_S)})
    try:
        yield up
    finally:
        up.stop()


# ---------------------------------------------------------------- the cluster's state


def health(up: UpProcess, name: str) -> tuple[int, dict]:
    url = up.reload()["services"][name]["health_url"]
    return (0, {}) if url is None else get_json(url, timeout_s=2.0)


def whole(up: UpProcess) -> dict:
    """What is not yet back: {child: why} (empty when every child answers and sees all the others)."""
    missing: dict[str, str] = {}
    for name in up.reload()["services"]:
        if name in ("nats-server", "redis-server"):
            continue
        try:
            status, body = health(up, name)
        except (OSError, ValueError) as exc:
            missing[name] = type(exc).__name__
            continue
        if status != 200 or body.get("status") != "ok":
            missing[name] = f"{status} {body.get('status')}"
        elif "decode_alive" in body and (body["prefill_alive"], body["decode_alive"]) != (2, 2):
            missing[name] = f"sees {body['prefill_alive']} prefill, {body['decode_alive']} decode"
        elif name in CONDUCTORS and len(body.get("conductors", ())) != len(CONDUCTORS):
            missing[name] = f"sees conductors {body.get('conductors')}"
    return missing


def wait_whole(up: UpProcess) -> float:
    """Seconds until every child is back and sees the others."""
    started = time.monotonic()
    eventually(lambda: whole(up), "every child of the cluster back and seeing the others",
               until=lambda missing: not missing, timeout_s=WHOLE_TIMEOUT_S, every_s=0.2)
    return time.monotonic() - started


def kv_held(up: UpProcess) -> dict[str, int]:
    """Per engine, the KV blocks not free, counting KV staged in host memory (a decode's) as the blocks it
    fills: 0 everywhere when the cluster is idle."""
    held = {}
    for name in ENGINES:
        body = health(up, name)[1]
        stats = body["stats"]
        block_bytes = body["measured_cost"]["kv_bytes_per_token"] * BLOCK_SIZE
        staged = -(-stats.get("kv_staging_bytes_used", 0) // block_bytes)
        held[name] = stats["kv_blocks_total"] - stats["kv_blocks_free"] + staged
    return held


def blocks_leaked(up: UpProcess) -> dict[str, int]:
    """The KV blocks each engine still holds SETTLE_S after the load stopped (all 0 when none leaked)."""
    with contextlib.suppress(AssertionError):
        eventually(lambda: kv_held(up), "every engine's KV blocks free", until=lambda held: not any(held.values()),
                   timeout_s=SETTLE_S, every_s=0.2, ignoring=(OSError, KeyError))
    return kv_held(up)


# ---------------------------------------------------------------- injecting faults


def pid(up: UpProcess, name: str) -> int:
    return up.reload()["services"][name]["pid"]


def serving(up: UpProcess, load: Load, name: str) -> int:
    """How many requests `name` is serving now, as far as one can tell from outside: a decode's streams the
    load sees it named on, a prefill's queued and running jobs."""
    if name.startswith("decode"):
        return len(load.in_flight(lambda answer: answer.decode == name))
    stats = health(up, name)[1]["stats"]
    return stats["requests_running"] + stats["requests_queued"]


def busiest(load: Load, role: str) -> str:
    """The instance of `role` named on the most of the load's recent requests."""
    named = [getattr(answer, role) for answer in load.answers[-4 * CLIENTS:]]
    counts = {name: named.count(name) for name in ENGINES if name.startswith(role)}
    return max(counts, key=lambda name: counts[name])


def busy_with_a_request(up: UpProcess, load: Load, name: str) -> None:
    """Wait (a few seconds at most) until engine `name` serves a request, so that the fault catches one."""
    with contextlib.suppress(AssertionError):
        eventually(lambda: serving(up, load, name), f"{name} serving a request", timeout_s=10.0, every_s=0.01,
                   ignoring=(OSError,))


def restarted(up: UpProcess, name: str, said_before: int) -> float:
    """When the server `name` (nats-server, redis-server) that up starts again listens on its port again."""
    up.wait_said(rf"{name} restarted \(pid \d+\)", after=said_before, timeout_s=60)
    url = urllib.parse.urlsplit(up.manifest["nats_url" if name == "nats-server" else "redis_url"])
    wait_for_port(url.hostname or "127.0.0.1", url.port or 0, 30)
    return time.monotonic()


def throttle(pid_: int, seconds: float) -> None:
    """Make a process a slow receiver: stopped for most of every period, running for the rest."""
    until = time.monotonic() + seconds
    try:
        while time.monotonic() < until:
            os.kill(pid_, signal.SIGSTOP)
            time.sleep(THROTTLE_PERIOD_S * (1 - THROTTLE_RUNNING))
            os.kill(pid_, signal.SIGCONT)
            time.sleep(THROTTLE_PERIOD_S * THROTTLE_RUNNING)
    finally:
        os.kill(pid_, signal.SIGCONT)


def inject(up: UpProcess, load: Load, fault: Fault, notes: dict) -> float:
    """Do `fault` to the running cluster; returns the moment it ended (time.monotonic())."""
    name = busiest(load, fault.target) if fault.target in ("prefill", "decode") else fault.target
    target = pid(up, name)
    if name in ENGINES:
        busy_with_a_request(up, load, name)
        notes["target"], notes["target_serving_at_fault"] = name, serving(up, load, name)
    notes["in_flight_at_fault"] = len(load.in_flight())
    if fault.action == "kill":
        os.kill(target, signal.SIGKILL)
        return time.monotonic()
    if fault.action == "stop":
        os.kill(target, signal.SIGSTOP)
        try:
            time.sleep(fault.stop_s)
        finally:
            os.kill(target, signal.SIGCONT)
        return time.monotonic()
    if fault.action == "restart":
        said, killed = len(up.said), time.monotonic()
        os.kill(target, signal.SIGKILL)
        back = restarted(up, name, said)
        notes["down_s"] = round(back - killed, 2)
        return back
    if fault.action == "throttle":
        throttle(target, THROTTLE_S)
        return time.monotonic()
    raise ValueError(f"unknown fault action {fault.action!r}")


# ---------------------------------------------------------------- running a scenario


def recovered(load: Load, fault_end: float) -> bool:
    """The last RUN_OF_SUCCESSES ended requests of those started after the fault's end all succeeded."""
    ended = [answer for answer in sorted(load.since(fault_end), key=lambda answer: answer.started) if answer.ended]
    return len(ended) >= RUN_OF_SUCCESSES and all(answer.ok for answer in ended[-RUN_OF_SUCCESSES:])


def run_on(load: Load, fault_end: float) -> None:
    """Keep the load going until the cluster serves normally again, or GRACE_S + TAIL_S after the fault's end."""
    deadline = fault_end + GRACE_S + TAIL_S
    while time.monotonic() < deadline and not recovered(load, fault_end):
        time.sleep(0.1)


def warm(load: Load) -> None:
    eventually(lambda: sum(answer.ok for answer in load.answers), "the load's first successes",
               until=lambda ok: ok >= CLIENTS, timeout_s=60)


def run(up: UpProcess, fault: Fault) -> tuple[Figures, dict[str, list[dict]]]:
    """One scenario from a whole cluster: load, the fault, the load on until served normally again, then
    the figures; the cluster is whole again when this returns (a killed child restarted)."""
    started = time.monotonic()
    notes: dict = {"cluster_whole_after_s": round(wait_whole(up), 1)}
    if fault.action == "overload":
        answers, fault_end = overload(up, notes)
    else:
        with Load(up.url, clients=CLIENTS) as load:
            warm(load)
            fault_end = inject(up, load, fault, notes)
            run_on(load, fault_end)
        answers = load.answers
    notes["back_whole_s"] = round(wait_whole(up), 1)
    figured, wrong = figures(fault.name, answers, fault_end, fault.bound_s, notes.pop("in_flight_at_fault", 0))
    held = blocks_leaked(up)
    figured.blocks_leaked = sum(held.values())
    figured.notes = {**notes, "scenario_s": round(time.monotonic() - started, 1), "refusals": refusal_reasons(answers)}
    if figured.blocks_leaked:
        wrong["KV blocks held when idle"] = [held]
    return figured, wrong


def overload(up: UpProcess, notes: dict) -> tuple[list[Answer], float]:
    """Measure the rate the cluster sustains (closed loop), then offer OVERLOAD_FACTOR times it (open loop)
    under the steady load; the overload ends when the extra arrivals stop."""
    with Load(up.url, clients=CAPACITY_CLIENTS, seed=1) as saturating:
        warm(saturating)
        measured_from = time.monotonic()
        time.sleep(CAPACITY_S)
        done = sum(answer.ok and answer.ended >= measured_from for answer in list(saturating.answers))
    capacity = max(done / CAPACITY_S, 1.0)
    notes["sustained_rps"], notes["offered_rps"] = round(capacity, 2), round(OVERLOAD_FACTOR * capacity, 2)
    with Load(up.url, clients=CLIENTS) as steady:
        warm(steady)
        notes["in_flight_at_fault"] = len(steady.in_flight())
        burst = Load(up.url, rate=OVERLOAD_FACTOR * capacity, seed=2)
        time.sleep(OVERLOAD_S)
        burst.stopping.set()
        fault_end = time.monotonic()
        run_on(steady, fault_end)
    return steady.answers + burst.stop(), fault_end


def problems(figured: Figures, wrong: dict[str, list[dict]]) -> dict:
    """What a scenario's assertion reports: empty when the run met every promise of issue 15."""
    found: dict[str, object] = {key: value[:8] for key, value in wrong.items() if value}
    if figured.recovery_s is None or figured.recovery_s > GRACE_S:
        found["seconds to recover"] = figured.recovery_s
    return found
