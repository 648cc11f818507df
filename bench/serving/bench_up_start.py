"""What `kvcentric up` costs to start, and a killed engine to come back: `--spawn exec` (every service a new
`python -m kvcentric` interpreter) against `--spawn fork` (the services forked from an `up` that imported them
once), in alternating rounds, for each shape given (--shapes; 1 prefill + 1 decode instance of each).

For each start: the wall seconds from launching `up` to its `ready at` line, and the CPU-seconds every process of
the cluster (`up` and each child, from /proc) had spent by then; then `decode-0` is killed with SIGKILL and the
seconds until its /health answers 200 again from its new process are timed (up's backoff of 0.5 s included).
Asserts nothing; writes bench/results/up_start.json.

    .venv/bin/python -m bench.serving.bench_up_start [--shapes tiny small] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time

import psutil
from bench import harness
from kvcentric.tools.processes import get_json
from bench.harness import UpProcess

RESULTS = harness.RESULTS / "up_start.json"
SPAWNS = ("exec", "fork")


def cpu_s(pid: int) -> float:
    """CPU-seconds (user + system) the process has spent so far (0 once it is gone)."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


def healthy_again(up: UpProcess, name: str, old_pid: int, timeout_s: float = 60.0) -> float:
    """Seconds until `name` answers /health from a process other than `old_pid`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        service = up.reload()["services"][name]
        if service["pid"] != old_pid and service["health_url"]:
            try:
                if get_json(service["health_url"])[0] == 200:
                    return time.monotonic() - started
            except (OSError, ValueError):
                pass
        time.sleep(0.02)
    raise TimeoutError(f"{name} did not come back in {timeout_s} s")


def one_start(shape: str, spawn: str) -> dict[str, float]:
    logs = tempfile.mkdtemp(prefix=f"kvc-up-start-{spawn}-")
    started = time.monotonic()
    up = UpProcess(logs, "--model", shape, "--spawn", spawn)
    ready_s = time.monotonic() - started
    try:
        pids = [up.process.pid, *up.pids()]
        cpu = sum(cpu_s(pid) for pid in pids)
        time.sleep(1.0)
        decode = up.reload()["services"]["decode-0"]["pid"]
        os.kill(decode, signal.SIGKILL)
        restart_s = healthy_again(up, "decode-0", decode)
    finally:
        up.stop()
    return {"ready_s": ready_s, "cpu_s": cpu, "restart_s": restart_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = {}
    for shape in args.shapes:
        runs: dict[str, list[dict[str, float]]] = {spawn: [] for spawn in SPAWNS}
        for round_ in range(args.rounds):
            for spawn in SPAWNS if round_ % 2 == 0 else reversed(SPAWNS):
                runs[spawn].append(one_start(shape, spawn))
                print(f"{shape} round {round_ + 1} {spawn:4}: " + "  ".join(
                    f"{key} {value:.2f}" for key, value in runs[spawn][-1].items()), flush=True)
        medians = {spawn: {key: statistics.median(run[key] for run in runs[spawn]) for key in runs[spawn][0]}
                   for spawn in SPAWNS}
        ratios = {key: medians["fork"][key] / medians["exec"][key] for key in medians["fork"]}
        results[shape] = {"runs": runs, "medians": medians, "fork_over_exec": ratios}
        print(f"{shape}: fork / exec, medians of {args.rounds}: " + "  ".join(
            f"{key} {medians['fork'][key]:.2f} / {medians['exec'][key]:.2f} = {ratio:.2f}x"
            for key, ratio in ratios.items()), flush=True)
    harness.write(RESULTS, harness.record("bench_up_start", rounds=args.rounds, shapes=results), indent=2)


if __name__ == "__main__":
    main()
