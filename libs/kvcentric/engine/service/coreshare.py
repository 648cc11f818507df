"""Cores lent between the engine instances of one machine: a model call runs on the instance's own torch threads
plus those of every instance beside it that is idle, so a prefill instance takes the decode instance's core
while that has nothing to decode, and gives it back within a layer once the decode has work again.

Each instance keeps a slot file in a directory the instances share (`--core-share-dir`; `kvcentric up` makes
one per cluster, in /dev/shm, when it starts several CPU engines): eight int64s, mapped into memory,

    pid, threads, computing (1 while a model call runs), ended_ns (CLOCK_MONOTONIC when the last call ended),
    using (the threads it computes on now), resumes_ns (when an instance that paused itself computes again),
    takes (1: a prefill instance, which takes lent cores within a call and for which a decode paces itself),
    waiting (a prefill instance's prompts queued behind the one it computes)

written by the instance's model thread and read by the others at the start of each model call and, in a prefill
instance, three times a layer (`LlamaModel.look`, `ModelThread.refresh`): a few hundred nanoseconds a look,
8-byte aligned loads and stores, whole on x86-64 and arm64, no lock. An instance is idle when it is not
computing and either its last call ended more than `IDLE_AFTER_NS` ago (a decode instance between two steps of
its batch, well under a millisecond apart, stays busy) or it paused itself until a time more than one look
away. A slot whose process is gone is dropped when the directory is next listed (`RESCAN_NS`), so a killed
instance lends nothing it does not have and a stale directory costs nothing.

A decode instance with `--lend-pace-s` paces itself while a prefill computes with 2 or more prompts queued
(`waiting`; the decode service's `PACE_BEHIND`): its steps start at most that often, and it pauses between
them (`pause`), so the prefill has both cores for most of each period and gives one back a look before the
decode's next step. The decode's tokens then come at that pace instead of its fastest (80 ms by default in
`kvcentric up`, 0.8 of the 0.1 s TBT SLO), only while prompts queue at the prefill.

Why: with one core per instance, the isolation of 1 prefill + 1 decode on two cores, a burst of prompts
queues on the prefill instance's one core while the decode instance has a core and little to do with it
(docs/performance.md, "Cores lent between instances", for the figures). Instances taking turns on all the
cores under a lock were measured too, and were slower: the waiting process's OpenMP team spins or sleeps at
every hand-over.

It decides thread counts only; it does not schedule requests.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from pathlib import Path

SLOT = struct.Struct("<8q")
"""pid, threads, computing, ended_ns, using, resumes_ns, takes, waiting."""
PID, THREADS, COMPUTING, ENDED_NS, USING, RESUMES_NS, TAKES, WAITING = range(8)
"""The fields' indices."""
SUFFIX = ".cores"
IDLE_AFTER_NS = 5_000_000
"""An instance whose last model call ended this long ago, and that has not started another, lends its threads."""
RESCAN_NS = 1_000_000_000
"""How often the directory is listed again for instances that came or went."""


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _alive(pid: int) -> bool:
    if pid <= 0:  # 0 or negative would name a process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_slots(directory: str | Path) -> list[Path]:
    """The slot files in `directory` whose instance's process is alive."""
    live = []
    for path in Path(directory).glob(f"*{SUFFIX}"):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if len(data) >= SLOT.size and _alive(SLOT.unpack_from(data)[PID]):
            live.append(path)
    return live


class Slot:
    """One instance's slot file, mapped."""

    def __init__(self, path: Path, create: bool = False) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, SLOT.size)
            elif os.fstat(fd).st_size < SLOT.size:
                raise ValueError(f"{path}: not a slot file")
            self.map = mmap.mmap(fd, SLOT.size)
        finally:
            os.close(fd)

    def read(self) -> tuple[int, ...]:
        return SLOT.unpack_from(self.map, 0)

    def write(self, index: int, value: int) -> None:
        """Field `index` := value; ValueError once closed."""
        if self.map.closed:
            raise ValueError(f"{self.path}: closed")
        struct.pack_into("<q", self.map, index * 8, value)

    def close(self) -> None:
        self.map.close()


class CoreShare:
    """This instance's slot and a view of the others'; `threads()` is what the next model call may use."""

    def __init__(self, directory: str | Path, name: str, threads: int, cores: int | None = None,
                 takes: bool = False) -> None:
        """`threads`: this instance's own; `cores`: the most any call may use (default: the usable CPUs);
        `takes`: this instance takes lent cores within a call too (a prefill instance)."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.own = threads
        self.cores = cores or usable_cores()
        self.mine = Slot(self.directory / f"{name}{SUFFIX}", create=True)
        self.mine.map[:] = SLOT.pack(os.getpid(), threads, 0, time.monotonic_ns(), threads, 0, int(takes), 0)
        self.peers: dict[Path, Slot] = {}
        self.scanned_ns = -RESCAN_NS
        self.takes = takes
        self.lock = threading.Lock()
        """`threads` from a prefill instance's two model threads at once (`node.Lane`): one rescans at a time."""
        self.lent_calls = 0
        """Model calls that ran on more threads than this instance's own."""
        self.closed = False

    def begin(self, borrow: bool = True) -> int:
        """A model call starts: marked as computing; returns the threads it may use (its own once closed, or when
        it may not `borrow`: a calibration times this instance's own speed)."""
        if not self._set((RESUMES_NS, 0), (COMPUTING, 1)):
            return self.own
        threads = self.threads() if borrow else self.own
        self._set((USING, threads))
        self.lent_calls += threads > self.own
        return threads

    def end(self) -> None:
        self._set((ENDED_NS, time.monotonic_ns()), (COMPUTING, 0))

    def using(self, threads: int) -> None:
        """The threads this instance computes on from now (a call changed them at a look)."""
        self._set((USING, threads))

    def pause(self, until_ns: int) -> None:
        """This instance computes nothing before `until_ns` (a paced decode): its threads are lent at once, and
        taken back by the others shortly before then (`threads(margin_ns)`)."""
        self._set((RESUMES_NS, until_ns))

    def waiting(self, prompts: int) -> None:
        """A prefill instance's prompts queued behind the one it computes now."""
        self._set((WAITING, prompts))

    def _set(self, *fields: tuple[int, int]) -> bool:
        """Write (index, value) fields of this slot in order; False once closed (the service stopped while a call
        was queued or running)."""
        try:
            for index, value in fields:
                self.mine.write(index, value)
        except ValueError:
            return False
        return True

    def taker_behind(self, waiting: int) -> bool:
        """Whether an instance beside this one that takes lent cores (a prefill) is in a model call now with at
        least `waiting` prompts queued behind it."""
        for slot in list(self.peers.values()):
            _, _, computing, _, _, _, takes, queued = slot.read()
            if computing and takes and queued >= waiting:
                return True
        return False

    def threads(self, margin_ns: int = 0, now_ns: int | None = None) -> int:
        """This instance's own threads plus those of every instance beside it that is idle and, if it paused
        itself, resumes more than `margin_ns` from now (the time between two looks: a core taken now is held until
        the next look); at most the usable cores less those the others hold: the threads a computing instance
        uses (lent ones included) and the own threads of one that is not idle. So two instances never borrow
        the same idle core, and a machine with more instances than cores gets no more threads than it had
        without lending."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        with self.lock:
            return self._threads(margin_ns, now_ns)

    def _threads(self, margin_ns: int, now_ns: int) -> int:
        if now_ns - self.scanned_ns >= RESCAN_NS:
            self.rescan(now_ns)
        threads, held = self.own, 0
        for slot in self.peers.values():
            _, peer_threads, computing, ended_ns, using, resumes_ns, _, _ = slot.read()
            if computing:
                held += using or peer_threads
                continue
            if resumes_ns > now_ns - IDLE_AFTER_NS:  # paused, resuming at resumes_ns
                idle = resumes_ns - now_ns > margin_ns
            else:
                idle = now_ns - ended_ns > IDLE_AFTER_NS
            if idle:
                threads += peer_threads
            else:
                held += peer_threads
        return max(1, min(self.own, self.cores), min(threads, self.cores - held))

    def rescan(self, now_ns: int) -> None:
        """Map the slots of instances that came, unmap those of instances whose process is gone."""
        self.scanned_ns = now_ns
        present = {path for path in self.directory.glob(f"*{SUFFIX}") if path != self.mine.path}
        for path in list(self.peers):
            if path not in present or not _alive(self.peers[path].read()[PID]):
                self.peers.pop(path).close()
        for path in present - self.peers.keys():
            try:
                slot = Slot(path)
            except (OSError, ValueError):
                continue
            if _alive(slot.read()[PID]):
                self.peers[path] = slot
            else:
                slot.close()

    def close(self) -> None:
        """Leave the share: this slot's file is removed (the others stop counting it at their next rescan)."""
        if self.closed:
            return
        self.closed = True
        for slot in self.peers.values():
            slot.close()
        self.peers.clear()
        self.mine.close()
        self.mine.path.unlink(missing_ok=True)
