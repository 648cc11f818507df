"""What the live compose checks of tests/deploy share: whether a Docker daemon can be used and the gate
(KVC_COMPOSE_CHECK=1, which `make compose-check` sets), a compose project of given files on free host ports, the
documented blocks of docs/operations.md they run as written, and the probe of a secured nats-server."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import ssl
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvcentric.tools.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
NATS_PROBE = Path(__file__).with_name("nats_probe.py")


def daemon_absent() -> str:
    """Why no Docker daemon can be used here ("" when one answers)."""
    if shutil.which("docker") is None:
        return "no docker CLI on this machine"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if info.returncode != 0:
        return f"no Docker daemon answers (`docker info`: {info.stderr.strip()[:200]})"
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        return "the docker CLI has no compose plugin"
    return ""


LIVE = [
    pytest.mark.timeout(3600),  # the first test builds the images and brings the stack up (minutes)
    pytest.mark.skipif(bool(daemon_absent()), reason=daemon_absent() or "-"),
    pytest.mark.skipif(os.environ.get("KVC_COMPOSE_CHECK") != "1",
                       reason="builds the images and runs the stack for minutes: `make compose-check` "
                              "(KVC_COMPOSE_CHECK=1) runs it"),
]
"""The marks of a live compose module: `pytestmark = LIVE`."""


class Project:
    """One compose project of `files` (docker compose -f each) on free host ports: `compose(...)` runs `docker
    compose` on it. Its name is COMPOSE_PROJECT_NAME in `env`, so a documented block run with `env` (`run_block`)
    acts on this project too."""

    def __init__(self, name: str, files: list[str], **variables: str) -> None:
        self.name, self.files = f"{name}-{os.getpid()}", files
        self.gateway_port, self.nats_port = free_port(), free_port()
        self.env = {**os.environ, "COMPOSE_PROJECT_NAME": self.name, "KVC_GATEWAY_PORT": str(self.gateway_port),
                    "KVC_NATS_PORT": str(self.nats_port), **variables}
        self.measured: dict = {}

    def compose(self, *args: str, timeout_s: float = 600, check: bool = True,
                stdin: str | None = None) -> subprocess.CompletedProcess:
        files = [part for name in self.files for part in ("-f", str(ROOT / name))]
        result = subprocess.run(["docker", "compose", *files, *args], capture_output=True, text=True, env=self.env,
                                cwd=ROOT, timeout=timeout_s, input=stdin)
        if check:
            assert result.returncode == 0, f"docker compose {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result

    def python(self, service: str, script: str, *args: str) -> str:
        """`script` run by the interpreter of `service`'s container (on its stdin), with `args`: its stdout."""
        return self.compose("exec", "-T", service, "python", "-", *args, stdin=script).stdout

    def health(self, service: str) -> dict:
        """GET /health inside `service`'s container on its own port (KVC_PORT; the engines publish none)."""
        read = ("import os, json, ssl, urllib.request as u\n"
                "tls = os.environ.get('KVC_HTTPS_CERT')\n"
                "url = ('https' if tls else 'http') + '://127.0.0.1:' + os.environ['KVC_PORT'] + '/health'\n"
                "context = ssl.create_default_context(cafile=os.environ['KVC_TLS_CA']) if tls else None\n"
                "print(u.urlopen(url, timeout=5, context=context).read().decode())\n")
        return json.loads(self.python(service, read))

    def seconds_to_healthy(self, last: str = "gateway") -> float:
        """From the first container's creation to the first passing health check of `last` (the service that
        starts once all the others are healthy), by Docker's own timestamps: the time a build or the CLI took is
        not in it. Docker keeps a container's last 5 checks: call it soon after `up --wait`."""
        ids = self.compose("ps", "-q").stdout.split()
        states = json.loads(subprocess.run(["docker", "inspect", *ids], capture_output=True, text=True,
                                           check=True).stdout)
        created = min(_time(state["Created"]) for state in states)
        (final,) = [state for state in states if state["Config"]["Labels"]["com.docker.compose.service"] == last]
        healthy = min(_time(check["End"]) for check in final["State"]["Health"]["Log"] if check["ExitCode"] == 0)
        return round(healthy - created, 1)

    def report(self, path: Path) -> None:
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(self.measured, indent=2) + "\n")

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--rmi", "local", "-t", "20", check=False)


def secured_project(name: str, files: list[str], material: Path) -> Project:
    """A `Project` of a secured layout: its certificates and secrets in `material` (KVC_SECURE_DIR), its gateway
    served over HTTPS (`url`)."""
    project = Project(name, files, KVC_SECURE_DIR=str(material))
    project.material = material
    project.url = f"https://localhost:{project.gateway_port}"
    return project


def _time(stamp: str) -> float:
    """Docker's RFC 3339 time (nanoseconds, Z) as seconds since the epoch."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    moment = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.UTC)
    return moment.timestamp() + float("0." + (fraction or "0"))


def doc_block(key: str, document: Path = OPERATIONS) -> str:
    """The one ```bash block of `document` that contains `key`."""
    found = [body for body in re.findall(r"^```bash\n(.*?)^```", document.read_text(), flags=re.S | re.M)
             if key in body]
    assert len(found) == 1, f"{len(found)} bash blocks of {document.name} contain {key!r}"
    return found[0]


def run_block(script: str, edits: list[tuple[str, str]], env: dict, timeout_s: float) -> tuple[str, float]:
    """A documented block run by bash in the checkout, after `edits` (old, new: each must still apply): its output
    and how long it took."""
    for old, new in edits:
        assert old in script, f"the documented block no longer contains {old!r}: update the edit"
        script = script.replace(old, new)
    env = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}  # this venv's `kvcentric`
    started = time.monotonic()
    result = subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=timeout_s)
    assert result.returncode == 0, f"exit {result.returncode}\n{script}\n{result.stdout[-3000:]}\n" \
                                   f"{result.stderr[-3000:]}"
    return result.stdout, round(time.monotonic() - started, 1)


def as_owner_edits(material: Path) -> list[tuple[str, str]]:
    """The documented blocks run the containers as the material's owner (`KVC_UID=$(id -u)`); run by root, they
    take the other documented way instead, the images' own user 10001 owning the files, so no container runs as
    root here either."""
    if os.getuid() != 0:
        return []
    return [("export KVC_UID=$(id -u) KVC_GID=$(id -g)", f"chown -R 10001:10001 {material}")]


def probe_nats(project: Project, service: str, host: str, user: str) -> dict[str, str]:
    """`nats_probe.py` run inside `service`'s container against `host`:4222, with that container's certificate
    and `user`'s password (its secret)."""
    tls = "/etc/kvcentric/tls"
    out = project.python(service, NATS_PROBE.read_text(), host, "4222", user, f"/run/secrets/nats-{user}.password",
                         f"{tls}/ca.pem", f"{tls}/service.pem", f"{tls}/service-key.pem")
    return json.loads(out)


def refused_all_but_the_user(attempts: dict[str, str]) -> None:
    assert attempts["plaintext"].startswith("tls_required=True: ") and "+OK" not in attempts["plaintext"] and \
        "PONG" not in attempts["plaintext"], attempts
    assert attempts["tls_without_certificate"].startswith("refused"), attempts
    assert "Authorization Violation" in attempts["certificate_without_user"], attempts
    assert "Authorization Violation" in attempts["certificate_wrong_password"], attempts
    assert attempts["certificate_and_user"] == "connected", attempts  # the probe itself can connect


def time_to_first_token(url: str, api_key: str = "", context: ssl.SSLContext | None = None, n: int = 20) -> dict:
    """TTFT of `n` streaming completions one after another (3 first to warm up), from the request to the first
    event: median and 90th percentile in ms, and the load average it was measured at (a shared machine's)."""
    def once(prompt: str) -> float:
        body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True})
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        started = time.perf_counter()
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", body.encode(), headers),
                                    timeout=60, context=context) as response:
            first = next(line for line in response if line.startswith(b"data: "))
            assert b'"error"' not in first, first
            elapsed = time.perf_counter() - started
            response.read()
        return elapsed

    for i in range(3):
        once(f"warm {i}")
    times = sorted(once(f"Hello number {i} from a container") for i in range(n))
    return {"median": round(statistics.median(times) * 1000, 1), "p90": round(times[int(0.9 * n) - 1] * 1000, 1),
            "requests": n, "load_average": [round(x, 2) for x in os.getloadavg()]}
