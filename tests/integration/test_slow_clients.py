"""Clients that send nothing, half a request head or a body too slowly cannot hold a real gateway's
connections (the gateway alone, on a real NATS): they are closed within --header-timeout-s, a slow body gets
a 408 in JSON, and beyond --max-connections the oldest idle connection makes room, so /health answers
throughout; when every connection is busy a newcomer gets a 503 in OpenAI's error shape."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest

from harness import spawn_service
from waiting import eventually

from kvcentric.tools.processes import get_json

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 3.0
CAP = 64
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
PARTIAL_BODY = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: 100\r\n\r\n{\"model\""


@pytest.fixture
def gateway(nats_url):
    process, port = spawn_service("gateway", nats_url, "--header-timeout-s", str(HEADER_TIMEOUT_S),
                                  "--body-timeout-s", str(BODY_TIMEOUT_S), "--max-connections", str(CAP))
    try:
        yield port
    finally:
        process.terminate()
        process.wait(10)


def open_sockets(port: int, count: int, first_bytes: bytes) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if first_bytes:
            sock.sendall(first_bytes)
        sockets.append(sock)
    return sockets


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as a close)."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def health(port: int) -> int:
    return get_json(f"http://127.0.0.1:{port}/health", timeout_s=5)[0]


def metric(port: int, name: str) -> float:
    """The value of kvc_<name> on the gateway's /metrics (0 when it is not there yet)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(f"kvc_{name}"))


def test_silent_and_half_sent_heads_are_closed_in_time_while_health_answers(gateway):
    started = time.monotonic()
    silent = open_sockets(gateway, 20, b"")
    half = open_sockets(gateway, 20, PARTIAL_HEAD)
    assert health(gateway) == 200
    for sock in half:  # a slowloris trickles more of its head, to no avail
        sock.sendall(b"X-Trickle: 1\r\n")
    for sock in silent + half:
        assert read_all(sock) == b""
        sock.close()
    assert time.monotonic() - started < HEADER_TIMEOUT_S + 5
    assert health(gateway) == 200


def test_a_body_sent_too_slowly_gets_a_408_in_json_and_a_close(gateway):
    (sock,) = open_sockets(gateway, 1, PARTIAL_BODY)
    started = time.monotonic()
    answer = read_all(sock)
    sock.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert BODY_TIMEOUT_S - 0.5 < time.monotonic() - started < BODY_TIMEOUT_S + 5


def test_beyond_the_cap_the_oldest_idle_connection_makes_room_for_health(gateway):
    idle = open_sockets(gateway, 3 * CAP, PARTIAL_HEAD)
    try:
        assert health(gateway) == 200
        assert metric(gateway, "http_connections_evicted_total") >= 2 * CAP
        assert read_all(idle[0]) == b""  # the oldest went first
    finally:
        for sock in idle:
            sock.close()


def test_when_every_connection_is_busy_a_newcomer_gets_a_503_then_health_comes_back(gateway):
    busy = open_sockets(gateway, CAP, PARTIAL_BODY)

    def refused_once_all_are_busy() -> bool:
        """A connection whose head is not parsed yet is idle (and closed to make room): top up until not."""
        if refused_with_503(gateway):
            return True
        busy.extend(open_sockets(gateway, 1, PARTIAL_BODY))
        return False
    try:
        eventually(refused_once_all_are_busy, "a connection over the cap is refused with a 503",
                   timeout_s=BODY_TIMEOUT_S, ignoring=(OSError,))
        eventually(lambda: health(gateway), "/health answers once the slow bodies got their 408",
                   until=lambda status: status == 200, timeout_s=BODY_TIMEOUT_S + 10, ignoring=(OSError,))
    finally:
        for sock in busy:
            sock.close()


def refused_with_503(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        head, _, body = read_all(sock).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 503"):
        return False
    assert b"Retry-After: 1" in head
    return json.loads(body)["error"]["code"] == "too_many_connections"


@pytest.mark.parametrize("head", [b"NOT HTTP AT ALL\r\n\r\n",
                                  b"GET /health HTTP/1.1\r\nX-Long: " + b"x" * 20_000 + b"\r\n\r\n"])
def test_a_head_aiohttp_cannot_parse_is_a_400_in_json(gateway, head):
    with socket.create_connection(("127.0.0.1", gateway), timeout=10) as sock:
        sock.sendall(head)
        status_line, _, rest = read_all(sock).partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert status_line.split()[1] == b"400" and b"application/json" in headers, (status_line, body)
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
