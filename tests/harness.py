"""Test and benchmark harness: one `kvcentric` service, or a whole `kvcentric up`, as a child process that
is ready when these return. Not part of the installed library.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from kvcentric.tools.processes import get_json, read_port_file


def spawn_service(command: str, nats_url: str, *flags: str, timeout_s: float = 60.0,
                  quiet: bool = True) -> tuple[subprocess.Popen, int]:
    """Start one `kvcentric <command>`, which binds a free HTTP port itself and writes it to a --port-file,
    and wait until its /health answers 200; returns (process, port). For tests and benchmarks; the process
    is killed if it never gets healthy."""
    port_file = os.path.join(tempfile.mkdtemp(prefix="kvcentric-port-"), "port")
    output = subprocess.DEVNULL if quiet else None
    process = subprocess.Popen([sys.executable, "-m", "kvcentric", command, "--nats-url", nats_url,
                                "--port", "0", "--port-file", port_file, *flags], stdout=output, stderr=output)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        port = read_port_file(port_file, process.pid)
        try:
            if port is not None and get_json(f"http://127.0.0.1:{port}/health")[0] == 200:
                return process, port
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    process.kill()
    process.wait()
    raise RuntimeError(f"kvcentric {command} did not become healthy in {timeout_s} s")


class UpProcess:
    """`kvcentric up` run as a child process, for tests and benchmarks: start, wait ready, stop. Its gateway
    binds a free port itself (--port 0) unless `port` is given; `url` is where it listens. What `up` prints
    after it is ready (restarts) is kept in `said`, read by `wait_said`."""

    def __init__(self, log_dir: str, *flags: str, port: int = 0, timeout_s: float = 120.0,
                 env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.ready_line = ""
        """What `up` said when it was ready (its URL, its servers, the SLOs in force)."""
        argv = [sys.executable, "-m", "kvcentric", "up", "--port", str(port), "--log-dir", log_dir,
                "--startup-timeout-s", str(timeout_s), *flags]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env={**os.environ, **(env or {})})
        self.url = self._wait_ready(timeout_s + 10)
        self.port = int(self.url.rsplit(":", 1)[1])
        self.said: list[str] = []
        threading.Thread(target=self._listen, daemon=True).start()
        self.reload()

    def _listen(self) -> None:
        for line in self.process.stdout:
            self.said.append(line)

    def _wait_ready(self, timeout_s: float) -> str:
        deadline, lines = time.monotonic() + timeout_s, []
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line and self.process.poll() is not None:
                break
            lines.append(line)
            ready = re.search(r"ready at (https?://\S+)", line)
            if ready:
                self.ready_line = line
                return ready.group(1)
        self.stop()
        raise RuntimeError("kvcentric up did not become ready:\n" + "".join(lines))

    def reload(self) -> dict:
        """cluster.json again (`up` rewrites it when a child restarts: new pid, maybe a new port)."""
        with open(os.path.join(self.log_dir, "cluster.json")) as manifest:
            self.manifest = json.load(manifest)
        return self.manifest

    def wait_said(self, pattern: str, timeout_s: float = 30.0, after: int = 0) -> str:
        """The first line `up` printed since it was ready (from line `after` on) that matches `pattern`
        (a regex); TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.said[after:]:
                if re.search(pattern, line):
                    return line
            time.sleep(0.1)
        raise TimeoutError(f"kvcentric up did not say /{pattern}/ in {timeout_s} s; it said:\n" + "".join(self.said))

    def health(self, service: str) -> dict:
        """GET /health of `service` as cluster.json names it now ({} while a restarted one has not bound its
        port yet)."""
        url = self.reload()["services"][service]["health_url"]
        return {} if url is None else get_json(url)[1]

    def pids(self) -> list[int]:
        return [s["pid"] for s in self.manifest["services"].values()]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()
