"""docker-compose.yml secured by docker-compose.secure.yml, for real, on a Docker daemon: the block of
docs/operations.md (`kvcentric certs`, `up --build -d --wait`, a completion over HTTPS with the API key) run as
written, then plain and streaming requests through the OpenAI client, a request without a key or with a wrong
one answered 401, a NATS client without a certificate or credentials kept off the compose nats-server's published
port, Redis refusing a client without its password, an engine's KV port refusing a peer without a certificate,
and every kvcentric container running as the images' user or the files' owner, never root. What it measured
(time to healthy, TTFT over HTTPS) goes to build/compose-secure-check.json for docs/operations.md.

Skipped as tests/deploy/test_compose_live.py is: where no Docker daemon answers, and unless KVC_COMPOSE_CHECK=1
(`make compose-check`). Pinned images can be pointed elsewhere with the variables docker-compose.yml names.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from composing import (LIVE, NATS_PROBE, ROOT, Project, as_owner_edits, doc_block, refused_all_but_the_user,
                       run_block, secured_project, time_to_first_token)

pytestmark = LIVE
REPORT = ROOT / "build" / "compose-secure-check.json"
BLOCK = "docker compose -f docker-compose.yml -f docker-compose.secure.yml up"
"""The key of the documented block this runs."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    material = tmp_path_factory.mktemp("secure") / "out"
    project = secured_project("kvc-secure", ["docker-compose.yml", "docker-compose.secure.yml"], material)
    started = time.monotonic()
    project.compose("build", timeout_s=1800)  # first, so that the block's `up --build` finds the images built
    project.measured["build_s"] = round(time.monotonic() - started, 1)
    try:
        output, took = run_block(doc_block(BLOCK), [("deploy/secure/out", str(material)),
                                                    ("localhost:8000", f"localhost:{project.gateway_port}"),
                                                    *as_owner_edits(material)],
                                 project.env, timeout_s=900)
        project.measured["block_s"] = took
        project.measured["healthy_s"] = project.seconds_to_healthy()
        project.block_output = output
        project.measured["containers"] = len(project.compose("ps", "-q").stdout.split())
        yield project
    finally:
        project.report(REPORT)
        project.down()


def key(stack: Project) -> str:
    with open(stack.material / "api-keys") as keys:
        return keys.readline().strip()


def tls(stack: Project) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(stack.material / "ca.pem"))


def complete(stack: Project, api_key: str | None, stream: bool = False, prompt: str = "Hello") -> tuple[float, dict]:
    """One completion over HTTPS: the time to its first byte of body and its JSON (a stream: the last chunk)."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream})
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(stack.url + "/v1/completions", body.encode(), headers)
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=60, context=tls(stack)) as response:
        if not stream:
            return time.perf_counter() - started, json.load(response)
        first, events = None, []
        for line in response:
            if line.startswith(b"data: "):
                first = first or time.perf_counter() - started
                events.append(line[6:].strip().decode())
        assert events[-1] == "[DONE]", events
        return first, json.loads(events[-2])


def test_the_documented_block_serves_a_completion_over_https_with_the_api_key(stack):
    body = json.loads(stack.block_output.strip().splitlines()[-1])  # after the line of `kvcentric certs`
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["text"]
    assert stack.measured["containers"] == 9


def test_plain_and_streaming_requests_through_the_openai_client(stack):
    openai = pytest.importorskip("openai")
    http = openai.DefaultHttpxClient(verify=tls(stack))
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=key(stack), http_client=http, max_retries=0,
                       timeout=60) as client:
        completion = client.completions.create(model="tiny", prompt="Hello, secured", max_tokens=8)
        assert completion.usage.completion_tokens == 8
        chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=6, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")  # a dummy model may end early
    decode = stack.health("decode")
    assert decode["stats"]["kv_streams_committed"] >= 3  # the KV crossed from the prefill container, over mTLS


def test_a_client_without_the_key_or_with_a_wrong_one_gets_401_and_plain_http_gets_nothing(stack):
    for api_key in (None, "sk-not-a-key-of-this-deployment"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            complete(stack, api_key)
        assert refused.value.code == 401 and json.load(refused.value)["error"]["code"] == "invalid_api_key"
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://localhost:{stack.gateway_port}/v1/models", timeout=10)
    _, last = complete(stack, key(stack), stream=True)
    assert last["choices"][0]["finish_reason"] == "length"


def test_nats_takes_no_client_without_a_certificate_and_credentials_on_its_published_port(stack):
    """From the host, as anyone who reaches the published port would: only the certificate and a user's password
    together connect."""
    m = stack.material
    probe = subprocess.run([sys.executable, str(NATS_PROBE), "localhost", str(stack.nats_port), "engine",
                            str(m / "nats-engine.password"), str(m / "ca.pem"), str(m / "service.pem"),
                            str(m / "service-key.pem")], capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    refused_all_but_the_user(json.loads(probe.stdout))


def test_redis_refuses_a_client_without_the_password(stack):
    answer = stack.compose("exec", "-T", "redis", "redis-cli", "ping", check=False)
    assert "NOAUTH" in answer.stdout + answer.stderr


KV_HANDSHAKE = """
import socket, ssl, sys
host, port = sys.argv[1].rsplit(":", 1)
def attempt(cert):
    context = ssl.create_default_context(cafile="/etc/kvcentric/tls/ca.pem")
    context.check_hostname = False  # peers are reached by address; the name they check is kvcentric-kv
    if cert:
        context.load_cert_chain("/etc/kvcentric/tls/service.pem", "/etc/kvcentric/tls/service-key.pem")
    context.set_alpn_protocols(["h2"])
    try:
        with context.wrap_socket(socket.create_connection((host, int(port)), timeout=5)) as tls:
            tls.sendall(b"PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n")
            tls.settimeout(5)
            return "answered" if tls.recv(64) else "closed"
    except (OSError, ssl.SSLError) as error:
        return "refused: " + type(error).__name__ + ": " + str(error)[:80]
print(attempt(False))
print(attempt(True))
"""


def test_an_engines_kv_port_refuses_a_peer_without_a_certificate_of_the_ca(stack):
    address = stack.health("decode")["kv_addr"]
    without, with_certificate = stack.python("gateway", KV_HANDSHAKE, address).splitlines()
    # no HTTP/2 answer without a certificate: an alert (certificate required) or the connection closed
    assert without == "closed" or "CERTIFICATE_REQUIRED" in without.upper(), without
    assert with_certificate == "answered", with_certificate


def test_no_container_runs_as_root_and_the_gateway_says_https(stack):
    owner = "10001" if os.getuid() == 0 else str(os.getuid())
    for service in ("nats", "redis", "kvs-meta", "conductor", "prefill", "decode", "messenger", "gateway"):
        assert stack.compose("exec", "-T", service, "id", "-u").stdout.strip() == owner, service
    assert "ready: https://" in stack.compose("logs", "gateway").stdout


def test_time_to_first_token_over_https(stack):
    stack.measured["ttft_ms"] = time_to_first_token(stack.url, key(stack), tls(stack))
    assert stack.measured["ttft_ms"]["p90"] < 30_000
