"""docker-compose.yml for real, on a Docker daemon: build, up, plain and streaming requests through 1P+1D, a decode
container's process killed with SIGKILL and restarted by its restart policy and serving again, decode scaled to 2
with work reaching both, down. What it measured (build time, image sizes, time to ready) goes to
build/compose-check.json for docs/deployment.md.

Skipped where no Docker daemon answers (CI has none) and unless KVC_COMPOSE_CHECK=1 (it builds images and runs ten
containers for minutes): `make compose-check` runs it. Pinned images can be pointed elsewhere with the variables
docker-compose.yml names (PYTHON_IMAGE, NATS_IMAGE, REDIS_IMAGE, TORCH_INDEX_URL, TORCH_WHEELS).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from composing import LIVE, time_to_first_token
from kvcentric.tools.processes import free_port
from waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
PROJECT = f"kvc-check-{os.getpid()}"
REPORT = ROOT / "build" / "compose-check.json"

pytestmark = LIVE


class Stack:
    """One compose project of docker-compose.yml on free host ports; `compose(...)` runs `docker compose` on it."""

    def __init__(self) -> None:
        self.gateway_port, self.nats_port = free_port(), free_port()
        self.env = {**os.environ, "KVC_GATEWAY_PORT": str(self.gateway_port), "KVC_NATS_PORT": str(self.nats_port)}
        self.url = f"http://127.0.0.1:{self.gateway_port}"
        self.measured: dict = {}

    def compose(self, *args: str, timeout_s: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(["docker", "compose", "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml"), *args],
                                capture_output=True, text=True, env=self.env, cwd=ROOT, timeout=timeout_s)
        if check:
            assert result.returncode == 0, f"docker compose {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result

    def health(self, service: str, index: int = 1) -> dict:
        """GET /health inside replica `index` of `service` (the engines publish no port of their own)."""
        read = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8080/health', timeout=5).read().decode())"
        return json.loads(self.compose("exec", "-T", "--index", str(index), service, "python", "-c", read).stdout)

    def container(self, service: str, index: int = 1) -> str:
        return self.compose("ps", "-q", service).stdout.split()[index - 1]

    def report(self) -> None:
        REPORT.parent.mkdir(exist_ok=True)
        REPORT.write_text(json.dumps(self.measured, indent=2) + "\n")


def complete(url: str, stream: bool = False, max_tokens: int = 8) -> dict | list[str]:
    """One completion: its JSON body, or for a stream its data lines."""
    body = json.dumps({"prompt": "Hello from a container", "max_tokens": max_tokens, "temperature": 0,
                       "stream": stream}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        if not stream:
            return json.load(response)
        return [line.decode().strip()[6:] for line in response if line.startswith(b"data: ")]


def serves(url: str) -> bool:
    try:
        return complete(url)["usage"]["completion_tokens"] >= 1
    except (urllib.error.URLError, OSError, KeyError, ValueError):
        return False


def image_bytes(image: str) -> int:
    out = subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", image], capture_output=True, text=True)
    return int(out.stdout.strip())


@pytest.fixture(scope="module")
def stack():
    stack = Stack()
    started = time.monotonic()
    stack.compose("build", timeout_s=1800)
    stack.measured["build_s"] = round(time.monotonic() - started, 1)
    stack.measured["image_mb"] = {name: round(image_bytes(f"{PROJECT}-{name}") / 1e6)
                                  for name in ("gateway", "decode")}
    try:
        started = time.monotonic()
        stack.compose("up", "-d", "--wait", "--wait-timeout", "600", timeout_s=700)
        stack.measured["ready_s"] = round(time.monotonic() - started, 1)
        stack.measured["containers"] = len(stack.compose("ps", "-q").stdout.split())
        yield stack
    finally:
        stack.report()
        stack.compose("down", "-v", "--remove-orphans", "--rmi", "local", "-t", "20", check=False)


def test_the_images_run_as_an_unprivileged_user_without_a_compiler_and_answer_help(stack):
    for service in ("decode", "gateway"):
        user = stack.compose("exec", "-T", service, "id", "-u").stdout.strip()
        assert user == "10001", service
        assert stack.compose("exec", "-T", service, "sh", "-c", "command -v g++ cc gcc c++", check=False).stdout == ""
    help_text = subprocess.run(["docker", "run", "--rm", f"{PROJECT}-decode", "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert help_text.startswith("usage: kvcentric decode") and "--kv-advertise" in help_text
    logs = stack.compose("logs", "decode").stdout
    # the kernels built ahead of time load (the choice among them and torch's ops runs only then) with no compiler
    assert "kernel choice" in logs and "kernels unavailable" not in logs


def test_plain_and_streaming_requests_go_through_prefill_and_decode(stack):
    for _ in range(3):
        body = complete(stack.url)
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"]
    events = complete(stack.url, stream=True)
    assert events[-1] == "[DONE]" and not any('"error"' in event for event in events)
    texts = [json.loads(event)["choices"][0]["text"] for event in events[:-1] if json.loads(event)["choices"]]
    assert "".join(texts)
    decode = stack.health("decode")
    assert decode["stats"]["kv_streams_committed"] >= 4  # KV moved from the prefill container over gRPC
    assert not decode["kv_addr"].startswith(("0.0.0.0", "127.")) and decode["instance_id"].startswith("decode-")


def test_time_to_first_token_over_plain_http(stack):
    """The plain figure beside test_compose_secure_live's over HTTPS (build/compose-check.json)."""
    stack.measured["ttft_ms"] = time_to_first_token(stack.url)
    assert stack.measured["ttft_ms"]["p90"] < 30_000


def test_tracing_export_stays_off_and_quiet_without_a_collector(stack):
    logs = stack.compose("logs").stdout
    assert "jaeger" not in stack.compose("ps", "--services").stdout
    assert "Failed to export" not in logs and "StatusCode.UNAVAILABLE" not in logs


def test_a_decode_killed_with_sigkill_is_restarted_by_docker_and_serves_again(stack):
    container = stack.container("decode")
    count = lambda: int(subprocess.run(["docker", "inspect", "-f", "{{.RestartCount}}", container],  # noqa: E731
                                       capture_output=True, text=True, check=True).stdout)
    before, old_id = count(), stack.health("decode")["instance_id"]
    stack.compose("exec", "-T", "decode", "sh", "-c", "kill -KILL -1", check=False)  # every process but init
    eventually(count, "docker restarted the decode container", until=lambda n: n > before, timeout_s=60)
    started = time.monotonic()
    eventually(lambda: serves(stack.url), "the stack serves again", until=bool, timeout_s=180, every_s=1.0)
    stack.measured["serving_again_after_kill_s"] = round(time.monotonic() - started, 1)
    assert stack.health("decode")["instance_id"] != old_id  # a new instance, found by the conductor on its own


def test_two_decode_replicas_each_take_work(stack):
    stack.compose("up", "-d", "--wait", "--wait-timeout", "300", "--scale", "decode=2", timeout_s=400)
    first, second = stack.health("decode", 1), stack.health("decode", 2)
    assert first["instance_id"] != second["instance_id"] and first["kv_addr"] != second["kv_addr"]
    before = [stack.health("decode", i)["stats"]["kv_streams_committed"] for i in (1, 2)]
    eventually(lambda: stack.health("conductor")["decode_alive"], "the conductor sees exactly the two decodes",
               until=lambda alive: alive == 2, timeout_s=90, every_s=1.0)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # load that overlaps, as traffic does
        assert all(pool.map(lambda _: serves(stack.url), range(24)))
    after = [stack.health("decode", i)["stats"]["kv_streams_committed"] for i in (1, 2)]
    assert all(a > b for a, b in zip(after, before)), (before, after)
    stack.measured["decode_replicas_work"] = [a - b for a, b in zip(after, before)]
