"""`kvcentric up --secure` on real servers: nats-server with TLS and one user per kind of service, the KV transfer
over mutual TLS, redis-server with a password, the gateway on HTTPS with an API key. A client without credentials
cannot reach NATS or Redis, a publish or subscription outside a user's permissions is refused (while the user
allowed gets through, so each check can fail), a KV push with no certificate or one of a foreign CA is refused, and
a request goes the whole secured path. One secured cluster serves the module."""

from __future__ import annotations

import datetime
import http.client
import itertools
import json
import os
import signal
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

import nats
import nats.errors
import pytest
import redis
from harness import UpProcess
from waiting import eventually_async

from kvcentric.proto import kv_pb2
from kvcentric.runtime.security import NatsAccess, TransferTls, client_context
from kvcentric.runtime.transfer import KVPusher, TransferError, checksum
from kvcentric.runtime import kvwire
from kvcentric.tools import certs
from kvcentric.tools.processes import get_json

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    up = UpProcess(str(tmp_path_factory.mktemp("secure-up")), "--secure", "--conductors", "1", "--decode", "2",
                   "--num-kv-blocks", "512")
    try:
        yield up
    finally:
        up.stop()


def secure_dir(up: UpProcess) -> str:
    return up.manifest["secure_dir"]


def path(up: UpProcess, name: str) -> str:
    return os.path.join(secure_dir(up), name)


def secret(up: UpProcess, name: str) -> str:
    with open(path(up, name)) as file:
        return file.read().strip()


def access(up: UpProcess, user: str) -> NatsAccess:
    return NatsAccess(up.manifest["nats_url"], user, secret(up, f"nats-{user}.password"), path(up, "ca.pem"),
                      path(up, "service.pem"), path(up, "service-key.pem"))


async def connect(url: str, errors: list | None = None, **options) -> nats.NATS:
    async def on_error(exc: Exception) -> None:
        if errors is not None:
            errors.append(str(exc))
    return await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0,
                              error_cb=on_error, **options)


def post(up: UpProcess, body: dict, key: str | None, context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(up.url + "/v1/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60, context=context or client_context(path(up, "ca.pem"))) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


# ---------------------------------------------------------------- NATS


def test_the_cluster_serves_over_https_with_its_servers_secured(secured):
    assert secured.url.startswith("https://") and secured.manifest["nats_url"].startswith("tls://")
    said = secured.wait_said("secured: CA")
    assert path(secured, "ca.pem") in said and secret(secured, "api-keys") not in "".join(secured.said)
    for name in ("nats.conf", "redis.conf", "api-keys", "service-key.pem", "nats-engine.password"):
        assert os.stat(path(secured, name)).st_mode & 0o077 == 0, name
    argv = " ".join(" ".join(open(f"/proc/{pid}/cmdline").read().split("\0")) for pid in secured.pids())
    for name in ("nats-engine.password", "nats-gateway.password", "redis.password", "api-keys"):
        assert secret(secured, name) not in argv  # paths on the command lines, never a secret


async def test_a_client_without_credentials_cannot_connect_to_nats(secured):
    url, ca = secured.manifest["nats_url"], path(secured, "ca.pem")
    good = access(secured, "gateway")
    refusals = {
        "no TLS, no user": {"servers": url.replace("tls://", "nats://")},
        "TLS without a client certificate": {"tls": client_context(ca), "user": "gateway", "password": good.password},
        "a certificate but no user": {"tls": client_context(ca, good.tls_cert, good.tls_key)},
        "a wrong password": {"tls": client_context(ca, good.tls_cert, good.tls_key), "user": "gateway",
                             "password": "guess"},
    }
    for what, options in refusals.items():
        target = options.pop("servers", url)
        with pytest.raises((nats.errors.Error, OSError, ssl.SSLError)):
            client = await connect(target, **options)
            await client.close()
            pytest.fail(f"{what}: connected")
    client = await connect(url, **good.options())  # the same server takes the right credentials
    assert client.is_connected
    await client.close()


async def test_a_publish_outside_a_users_permissions_never_reaches_an_engine(secured):
    url = secured.manifest["nats_url"]
    engine = await connect(url, **access(secured, "engine").options())
    gateway_errors: list[str] = []
    gateway = await connect(url, gateway_errors, **access(secured, "gateway").options())
    conductor = await connect(url, **access(secured, "conductor").options())
    job_subject = "kvc.prefill.nobody-here.submit"
    try:
        received = await engine.subscribe(job_subject)
        await engine.flush()
        await gateway.publish(job_subject, b"a job from the gateway")
        await gateway.flush()
        with pytest.raises(nats.errors.TimeoutError):
            await received.next_msg(timeout=1.0)
        assert any("permissions violation for publish" in error and job_subject in error for error in gateway_errors)
        await conductor.publish(job_subject, b"a job from a conductor")  # the user allowed to: it gets through
        assert (await received.next_msg(timeout=5.0)).data == b"a job from a conductor"
    finally:
        for client in (engine, gateway, conductor):
            await client.close()


async def test_a_subscription_outside_a_users_permissions_is_refused(secured):
    url = secured.manifest["nats_url"]
    for user, subject in (("engine", "kvc.req.*.out"), ("gateway", "kvc.kv.events.>"),
                          ("gateway", "_INBOX.conductor.>"), ("messenger", "kvc.load.>")):
        errors: list[str] = []
        client = await connect(url, errors, **access(secured, user).options())
        try:
            await client.subscribe(subject)
            await client.flush()
            await eventually_async(lambda seen=errors: seen, f"{user} refused a subscription to {subject}",
                                   until=lambda seen: any("permissions violation for subscription" in error
                                                          for error in seen), timeout_s=5)
        finally:
            await client.close()


# ---------------------------------------------------------------- the KV transfer


def decode_kv_addr(up: UpProcess) -> str:
    return get_json(up.manifest["services"]["decode-0"]["health_url"])[1]["kv_addr"]


async def one_layer_push():
    data = b"\x01" * 64
    yield kv_pb2.KVHeader(request_id="intruder-1", num_layers=1, num_tokens=1, num_kv_heads=1, head_dim=16,
                          dtype="float32", token_ids=[1])
    yield kvwire.LayerData(0, 0, 1, data, data, checksum(data, data))
    yield kv_pb2.KVCommit()


def foreign_tls() -> TransferTls:
    """A certificate with the right name, signed by a CA that is not the deployment's."""
    now = datetime.datetime.now(datetime.UTC)
    ca = certs.new_ca("someone else's CA", now)
    issued = certs.issue(ca, "intruder", ["127.0.0.1", "kvcentric-kv"], now)
    return TransferTls(ca.cert_pem, issued.cert_pem, issued.key_pem)


async def test_a_kv_push_with_no_certificate_or_a_foreign_one_is_refused(secured):
    addr = decode_kv_addr(secured)
    before = get_json(secured.manifest["services"]["decode-0"]["health_url"])[1]["stats"]
    with open(path(secured, "ca.pem"), "rb") as ca, open(path(secured, "service.pem"), "rb") as cert, \
            open(path(secured, "service-key.pem"), "rb") as key:
        deployment = TransferTls(ca.read(), cert.read(), key.read())
    for what, tls in (("no certificate", None), ("a foreign CA's certificate", foreign_tls())):
        pusher = KVPusher(shared_memory=False, tls=tls)
        try:
            with pytest.raises(TransferError, match="UNAVAILABLE") as refused:
                await pusher.push(addr, one_layer_push(), timeout_s=5.0)
            assert addr in str(refused.value), what
        finally:
            await pusher.close()
    member = KVPusher(shared_memory=False, tls=deployment)  # the deployment's own certificate is served
    try:
        reply = await member.stub(addr).Stats(kv_pb2.StatsRequest(), timeout=5.0)
        assert reply is not None
    finally:
        await member.close()
    after = get_json(secured.manifest["services"]["decode-0"]["health_url"])[1]["stats"]
    assert after.get("streams_received", 0) == before.get("streams_received", 0)


# ---------------------------------------------------------------- Redis and the gateway


def test_redis_refuses_a_client_without_the_password(secured):
    url = secured.manifest["redis_url"]
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(url, socket_timeout=2).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(url, password="guess", socket_timeout=2).ping()
    assert redis.Redis.from_url(url, password=secret(secured, "redis.password"), socket_timeout=2).ping()


def test_the_whole_request_path_works_secured_and_the_api_wants_a_key(secured):
    body = {"model": "tiny", "prompt": "Hello secured world, " * 4, "max_tokens": 8, "temperature": 0}
    status, answer = post(secured, body, secret(secured, "api-keys"))
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["finish_reason"] == "length"
    streams = sum(get_json(secured.manifest["services"][name]["health_url"])[1]["stats"].get("streams_received", 0)
                  for name in ("decode-0", "decode-1"))
    assert streams >= 1  # the prompt's KV came over the mutual-TLS transfer
    for key in (None, "sk-wrong"):
        status, answer = post(secured, body, key)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    with pytest.raises(urllib.error.URLError) as untrusted:  # a client without the deployment's CA refuses it
        post(secured, body, secret(secured, "api-keys"), ssl.create_default_context())
    assert isinstance(untrusted.value.reason, ssl.SSLCertVerificationError)
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # no plain HTTP on the HTTPS port
        urllib.request.urlopen(secured.url.replace("https://", "http://") + "/health", timeout=5)


def test_kvcentric_role_reaches_the_engines_as_admin_and_nothing_without_credentials(secured):
    url = secured.manifest["nats_url"]
    admin = ["--tls-ca", path(secured, "ca.pem"), "--tls-cert", path(secured, "service.pem"), "--tls-key",
             path(secured, "service-key.pem"), "--nats-user", "admin", "--nats-password-file",
             path(secured, "nats-admin.password")]
    run = [sys.executable, "-m", "kvcentric", "role", "nobody-here", "prefill", "--nats-url", url]
    allowed = subprocess.run([*run, *admin], capture_output=True, text=True, timeout=60)
    assert allowed.returncode == 1 and "no engine 'nobody-here' listens" in allowed.stderr, allowed.stderr
    refused = subprocess.run(run, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "no engine" not in refused.stderr


# ---------------------------------------------------------------- migration, last: it kills a decode instance


def stream_events(up: UpProcess, body: dict):
    """A streamed completion over HTTPS with the API key: (its decode instance, an iterator of its events)."""
    parts = urllib.parse.urlsplit(up.url)
    connection = http.client.HTTPSConnection(parts.hostname, parts.port, timeout=120,
                                             context=client_context(path(up, "ca.pem")))
    connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                       {"Content-Type": "application/json", "Authorization": f"Bearer {secret(up, 'api-keys')}"})
    response = connection.getresponse()
    assert response.status == 200, response.read()

    def events():
        try:
            while line := response.readline():
                if line.startswith(b"data: {"):
                    yield json.loads(line[len(b"data: "):])
        finally:
            connection.close()
    return response.getheader("x-kvcentric-decode"), events()


def streamed_text(events) -> tuple[str, list]:
    text, errors = "", []
    for event in events:
        errors += [event["error"]] if "error" in event else []
        text += "".join(choice.get("text", "") for choice in event.get("choices", []))
    return text, errors


def migrations(up: UpProcess) -> float:
    """kvc_migrations_total of the gateway's /metrics (over HTTPS; the metrics need no key)."""
    with urllib.request.urlopen(up.url + "/metrics", timeout=10, context=client_context(path(up, "ca.pem"))) as r:
        lines = r.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("kvc_migrations_total"))


def test_a_stream_whose_decode_instance_is_killed_migrates_over_the_secured_hops(secured):
    body = {"model": "tiny", "prompt": [3 + (i * 11) % 250 for i in range(80)], "max_tokens": 300,
            "temperature": 0, "ignore_eos": True}
    reference, errors = streamed_text(stream_events(secured, body)[1])
    assert errors == [] and reference
    before = migrations(secured)
    decode, events = stream_events(secured, body)
    first = next(events)  # its decode instance is generating
    os.kill(secured.reload()["services"][decode]["pid"], signal.SIGKILL)
    text, errors = streamed_text(itertools.chain([first], events))
    assert errors == [] and text == reference  # re-placed, pushed and pulled again over the secured hops
    assert migrations(secured) == before + 1
