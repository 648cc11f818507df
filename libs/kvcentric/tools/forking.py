"""`kvcentric up` starts its services by forking itself, once it has imported them: a child is a copy of `up`
that runs `kvcentric <command> <flags>` as `python -m kvcentric` would, without importing Python, torch and the
service's packages again.

Each `python -m kvcentric <service>` spends most of its start importing: about 1 CPU-second for a control-plane
service (NATS, aiohttp, OpenTelemetry, numpy) and 3 for an engine (torch), measured on the 2-core AMD EPYC VM, so a
cluster of 2 engines and 5 services spent about 12 CPU-seconds and 7 s of wall time to become ready, and a
restarted engine 3 s before it even parsed its flags. Forked from an `up` that imported them once, each child pays
only for its own work (docs/performance.md, "Starting a cluster").

A fork is safe here because `up` is one thread that has computed nothing: it imports modules and runs no torch op
(no OpenMP team, no CUDA context: an engine on a GPU is started with `exec`, as before), no event loop, no gRPC
channel. The child is `up`'s own child, so `up` waits for it, restarts it and reaps it as it did a `Popen`; it gets
its own process group, dies with `up`, reads /dev/null, writes its log, and carries its command line as its
title (`ps`, /proc/<pid>/cmdline), so it looks as it did. `up --spawn exec` starts each service as a new
interpreter instead.
"""

from __future__ import annotations

import gc
import importlib
import io
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

from kvcentric.registry import ENGINE_ROLES, service_class

CONTROL_PLANE = ("kvs-meta", "conductor", "gateway")


def forks(argv: list[str]) -> bool:
    """Whether `argv` is a `python -m kvcentric <service>` this process can fork instead (itself that Python)."""
    return argv[:3] == [sys.executable, "-m", "kvcentric"] and len(argv) > 3


def preload(commands: list[str]) -> list[str]:
    """Import what each of these `kvcentric` services imports to start (an engine's torch too), so that the
    children forked after it find them imported; returns the commands preloaded (a service whose packages do not
    import here, torch missing say, is left to import itself in its child, and says why there)."""
    try:  # set up here, in `up`: its children write their titles over `up`'s command line and environment
        import setproctitle  # noqa: F401
    except ImportError:
        pass
    loaded = []
    for command in commands:
        try:
            service_class(command)
            if command in ENGINE_ROLES:
                importlib.import_module("torch")
        except Exception:  # noqa: BLE001 (the child imports it again and reports the error in its own log)
            continue
        loaded.append(command)
    gc.collect()
    gc.freeze()  # what is imported now is never collected: children do not copy its pages by touching it
    return loaded


class Forked:
    """A forked child, waited as a `subprocess.Popen` is: pid, poll, wait, send_signal, terminate, kill and
    returncode (negative: the signal that ended it)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid, self.args = pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, its status unknown
                self.returncode = 255
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_command(argv: list[str], log_fd: int, die_with_parent: Callable[[], None]) -> Forked:
    """Fork a child that runs `argv` (a `python -m kvcentric ...` that `forks`) with its output on `log_fd`;
    `die_with_parent` makes it end with this process (`processes._die_with_parent`)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # what this process has printed is not printed again by the child
    pid = os.fork()
    if pid:
        return Forked(pid, argv)
    code = 1
    try:  # the child: it never returns into its parent's code, whatever happens
        code = _run_child(argv, log_fd, die_with_parent)
    except SystemExit as exit_:
        code = _exit_code(exit_)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _run_child(argv: list[str], log_fd: int, die_with_parent: Callable[[], None]) -> int:
    os.setpgid(0, 0)  # as `process_group=0`: a terminal's Ctrl-C reaches `up` alone, which stops the rest in order
    die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # `up`'s handlers are not the service's
    signal.signal(signal.SIGINT, signal.default_int_handler)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.closerange(3, _max_fd())  # as Popen's close_fds: none of `up`'s other files stays open here
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True)
    _set_title(argv)
    os.environ["PYTHONUNBUFFERED"] = "1"  # (what its own children inherit; its streams are unbuffered already)
    sys.argv = [sys.argv[0], *argv[3:]]
    runpy.run_module("kvcentric", run_name="__main__", alter_sys=True)  # what `python -m kvcentric` runs
    return 0


def _exit_code(exit_: SystemExit) -> int:
    """The status `python` exits with for this SystemExit (a message: printed, 1)."""
    if exit_.code is None:
        return 0
    if isinstance(exit_.code, int):
        return exit_.code & 0xFF
    print(exit_.code, file=sys.stderr)
    return 1


def _max_fd() -> int:
    try:
        return os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        return 1024


def _set_title(argv: list[str]) -> None:
    """The child's command line, as `ps` and /proc/<pid>/cmdline show it: the one it would have been started with
    (setproctitle; where it is missing, the child shows `up`'s)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(" ".join(argv))
