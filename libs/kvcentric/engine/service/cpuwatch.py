"""Whether the machine was busy with other work while this engine timed something: how many cores other processes
used meanwhile (from /proc/stat, less this process's own CPU time; steal counts as used) and what share of the cores
it asked for this process got. A timing taken while either is off measured the crowd, not the engine. Linux only;
elsewhere it sees nothing and calls every stretch quiet. It measures; it decides nothing about requests.
"""

from __future__ import annotations

import dataclasses
import os
import time

OTHERS_SLACK_CORES = 0.35
"""Cores other processes may use beyond those this engine leaves free before a stretch counts as busy (the
services beside an engine, idle, use a few hundredths of one)."""
OWN_SHARE_MIN = 0.5
"""A stretch in which this process got less than this share of the CPU time its threads asked for counts as busy
(descheduled, or held up by something that is not its work)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    wall_s: float
    busy_s: float
    """CPU seconds every process used (steal included), over all cores."""
    own_s: float
    """CPU seconds this process used, all its threads."""


@dataclasses.dataclass(frozen=True, slots=True)
class Stretch:
    """What a stretch of time looked like to the CPU."""

    seconds: float
    others_cores: float
    """Cores other processes kept busy on average (0 where it cannot be seen)."""
    own_share: float
    """CPU time this process got over wall time x the threads it computed with (1 where it cannot be seen)."""
    busy: bool

    def describe(self) -> str:
        return (f"{'busy' if self.busy else 'quiet'}: other processes used {self.others_cores:.2f} cores, this one "
                f"{self.own_share:.0%} of what it asked for, over {self.seconds:.2f} s")


class CpuWatch:
    """Started when a timing begins; `stretch(threads)` says whether the machine was busy meanwhile."""

    def __init__(self, cores: int | None = None, check_own: bool = True) -> None:
        """`check_own`: judge the process's own share too (off where it waits on a device, not a CPU)."""
        self.cores = cores or os.cpu_count() or 1
        self.check_own = check_own
        self.start = sample()

    def stretch(self, threads: int) -> Stretch:
        """The stretch since this watch started, for a process computing on `threads` threads."""
        return judge(self.start, sample(), self.cores, threads, self.check_own)


def judge(start: Sample | None, end: Sample | None, cores: int, threads: int, check_own: bool = True) -> Stretch:
    """What happened between two samples, for a process computing on `threads` of the machine's `cores`."""
    if start is None or end is None or end.wall_s <= start.wall_s:
        return Stretch(0.0, 0.0, 1.0, False)
    wall = end.wall_s - start.wall_s
    own = end.own_s - start.own_s
    others = max(0.0, (end.busy_s - start.busy_s) - own) / wall
    threads = max(1, min(threads, cores))
    share = min(1.0, own / (wall * threads))
    busy = others > max(0, cores - threads) + OTHERS_SLACK_CORES or (check_own and share < OWN_SHARE_MIN)
    return Stretch(wall, others, share, busy)


def sample() -> Sample | None:
    """Now, as /proc/stat and this process's CPU clock see it (None where /proc/stat cannot be read)."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return Sample(time.monotonic(), (user + nice + system + irq + softirq + steal) / tick, time.process_time())
