"""Who may connect to a secured nats-server: `python nats_probe.py HOST PORT USER PASSWORD_FILE CA CERT KEY` (on the
host, or inside a kvcentric container with the script on stdin: `python - ...`). Prints one JSON object: each
attempt -> "connected" or why it was refused. A plain client (no TLS, no credentials), a TLS client without a
certificate, one with a certificate but no user or a wrong password, and the user itself with the right one."""

import asyncio
import json
import socket
import ssl
import sys

import nats

HOST, PORT, USER, PASSWORD_FILE, CA, CERT, KEY = sys.argv[1], int(sys.argv[2]), *sys.argv[3:8]


def plaintext() -> str:
    """No TLS and no credentials: the INFO line, then a plain CONNECT."""
    with socket.create_connection((HOST, PORT), timeout=5) as sock:
        info = json.loads(sock.recv(4096).decode().split(" ", 1)[1])
        sock.sendall(b'CONNECT {"verbose": false}\r\nPING\r\n')
        try:
            answer = sock.recv(4096).decode().strip() or "closed by the server"
        except OSError as error:
            answer = f"closed by the server ({error})"
    return f"tls_required={info.get('tls_required')}: {answer}"


async def quiet(error: Exception) -> None:
    """nats-py reports each failed attempt here too; the attempt's own exception says it."""


async def attempt(**options) -> str:
    try:
        client = await nats.connect(f"tls://{HOST}:{PORT}", connect_timeout=5, allow_reconnect=False,
                                    max_reconnect_attempts=0, error_cb=quiet, **options)
    except Exception as error:  # noqa: BLE001 - the reason is the result
        return f"refused: {type(error).__name__}: {error}"[:160]
    await client.close()
    return "connected"


async def main() -> None:
    ca_only = ssl.create_default_context(cafile=CA)
    with_cert = ssl.create_default_context(cafile=CA)
    with_cert.load_cert_chain(CERT, KEY)
    password = open(PASSWORD_FILE).read().strip()
    print(json.dumps({
        "plaintext": plaintext(),
        "tls_without_certificate": await attempt(tls=ca_only, user=USER, password=password),
        "certificate_without_user": await attempt(tls=with_cert),
        "certificate_wrong_password": await attempt(tls=with_cert, user=USER, password="kvc-wrong"),
        "certificate_and_user": await attempt(tls=with_cert, user=USER, password=password),
    }, indent=1))


asyncio.run(main())
