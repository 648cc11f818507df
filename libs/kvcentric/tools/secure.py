"""What `kvcentric up --secure` runs a cluster with: a throwaway CA and the certificates it signs, a random
password for each NATS user and for Redis, an API key for the gateway, all in one folder only its owner may
read, and the nats-server and redis-server configs that use them (TLS, one user per kind of service with the
permissions of `core/permissions.py`, Redis AUTH). Every service is handed the paths, never a secret: nothing
secret reaches a command line or a log.

It makes files and configs; it starts nothing (`tools/up.py` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import secrets
from collections.abc import Sequence

from kvcentric.config import KV_SERVER_NAME
from kvcentric.core.permissions import ROLES, permissions, user_of
from kvcentric.tools.certs import new_ca, issue, write_pair, write_private

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class SecureFiles:
    """The paths of one secured cluster's material (`make_secure_files`)."""

    folder: str
    ca: str
    nats_cert: str
    nats_key: str
    service_cert: str
    service_key: str
    gateway_cert: str
    gateway_key: str
    redis_password: str
    api_keys: str
    nats_conf: str
    redis_conf: str

    def nats_password(self, user: str) -> str:
        return os.path.join(self.folder, f"nats-{user}.password")

    def service_flags(self, command: str) -> list[str]:
        """The flags that secure `kvcentric <command>`: the CA and the service certificate, its NATS user and
        password file; the gateway's HTTPS and API keys, kvs-meta's Redis password."""
        flags = ["--tls-ca", self.ca, "--tls-cert", self.service_cert, "--tls-key", self.service_key,
                 "--nats-user", user_of(command), "--nats-password-file", self.nats_password(user_of(command))]
        if command == "gateway":
            flags += ["--https-cert", self.gateway_cert, "--https-key", self.gateway_key,
                      "--api-keys-file", self.api_keys]
        if command == "kvs-meta":
            flags += ["--redis-password-file", self.redis_password]
        return flags


def password() -> str:
    """A random password of URL-safe characters (nothing a config file would need to escape), starting with a
    letter (nats-server reads a variable's value as a config value: one starting with a digit could be a number)."""
    return "kvc" + secrets.token_urlsafe(24)


def _quoted(subjects: Sequence[str]) -> str:
    return "[" + ", ".join(f'"{subject}"' for subject in subjects) + "]"


def _direction(subjects: Sequence[str]) -> str:
    """A permission direction: the subjects allowed, or every subject denied when there are none."""
    return f"{{allow: {_quoted(subjects)}}}" if subjects else '{deny: [">"]}'


def nats_user_block(user: str, secret: str) -> str:
    """One user of nats-server's `authorization { users: [...] }`, with its permissions; a `secret` that starts
    with `$` is a variable nats-server reads from its environment."""
    granted = permissions(user)
    responses = ", allow_responses: true" if granted.responds else ""
    shown = secret if secret.startswith("$") else f'"{secret}"'
    return (f'    {{user: "{user}", password: {shown}, permissions: {{\n'
            f"      publish: {_direction(granted.publish)}\n"
            f"      subscribe: {_direction(granted.subscribe)}{responses}\n    }}}}")


def nats_conf(ca: str, cert: str, key: str, passwords: dict[str, str]) -> str:
    """nats-server config: clients over TLS only, each presenting a certificate the CA signed (`verify`), and
    logging in as one of `passwords`' users with that user's permissions."""
    users = "\n".join(nats_user_block(user, secret) for user, secret in passwords.items())
    return (f"# Written by kvcentric up --secure: TLS with client certificates, one user per kind of service.\n"
            f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n  ca_file: "{ca}"\n  verify: true\n'
            f"  timeout: 2\n}}\n"
            f"authorization {{\n  timeout: 2\n  users: [\n{users}\n  ]\n}}\n")


def redis_conf(secret: str) -> str:
    """redis-server config: every client must AUTH with `secret` (the default user's password), and a replica
    uses it to follow its primary."""
    return f"# Written by kvcentric up --secure (or kvcentric certs).\nrequirepass {secret}\nmasterauth {secret}\n"


def password_variable(user: str) -> str:
    """The environment variable a deployment's nats-server reads `user`'s password from (`NATS_USERS_CONF`)."""
    return "NATS_PASSWORD_" + user.upper().replace("-", "_")


def _named(hosts: Sequence[str]) -> list[str]:
    return list(dict.fromkeys([*LOOPBACK, *(h for h in hosts if h not in ("", "0.0.0.0", "::"))]))


def make_secure_files(folder: str, gateway_hosts: Sequence[str] = (), nats_hosts: Sequence[str] = (),
                      now: datetime.datetime | None = None) -> SecureFiles:
    """Make the CA, the certificates, the passwords, the API key and both server configs in `folder` (created,
    owner only); the gateway's certificate also names `gateway_hosts`, nats-server's `nats_hosts`. The NATS
    passwords are also written as `nats-passwords.env` (NAME=value lines, for a container's environment).
    Returns their paths."""
    now = now or datetime.datetime.now(datetime.UTC)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    ca = new_ca("kvcentric up --secure CA", now)
    ca_path = os.path.join(folder, "ca.pem")
    with open(ca_path, "wb") as out:
        out.write(ca.cert_pem)
    nats_cert, nats_key = write_pair(issue(ca, "nats-server", _named(nats_hosts), now), folder, "nats")
    service_cert, service_key = write_pair(issue(ca, "kvcentric service", [*LOOPBACK, KV_SERVER_NAME], now),
                                           folder, "service")
    gateway_cert, gateway_key = write_pair(issue(ca, "kvcentric gateway", _named(gateway_hosts), now), folder,
                                           "gateway")
    passwords = {user: password() for user in ROLES}
    for user, secret in passwords.items():
        write_private(os.path.join(folder, f"nats-{user}.password"), secret.encode() + b"\n")
    write_private(os.path.join(folder, "nats-passwords.env"),
                  "".join(f"{password_variable(user)}={secret}\n" for user, secret in passwords.items()).encode())
    redis_secret = password()
    files = SecureFiles(
        folder=folder, ca=ca_path, nats_cert=nats_cert, nats_key=nats_key, service_cert=service_cert,
        service_key=service_key, gateway_cert=gateway_cert, gateway_key=gateway_key,
        redis_password=write_private(os.path.join(folder, "redis.password"), redis_secret.encode() + b"\n"),
        api_keys=write_private(os.path.join(folder, "api-keys"), f"sk-{secrets.token_hex(24)}\n".encode()),
        nats_conf=write_private(os.path.join(folder, "nats.conf"),
                                nats_conf(ca_path, nats_cert, nats_key, passwords).encode()),
        redis_conf=write_private(os.path.join(folder, "redis.conf"), redis_conf(redis_secret).encode()))
    return files


def users_conf() -> str:
    """The `authorization` block of a deployment's nats-server: every user and its permissions, each password
    read from the server's environment (`password_variable`), so the file holds no secret (`deploy/`)."""
    users = "\n".join(nats_user_block(user, "$" + password_variable(user)) for user in ROLES)
    return (f"# Written by `kvcentric certs --users-conf` from libs/kvcentric/core/permissions.py: do not edit.\n"
            f"authorization {{\n  timeout: 2\n  users: [\n{users}\n  ]\n}}\n")


def certs_parser() -> argparse.ArgumentParser:
    """The arguments of `kvcentric certs`."""
    parser = argparse.ArgumentParser(prog="kvcentric certs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder to write the CA, certificates, passwords and API key to")
    parser.add_argument("--nats-host", action="append", default=[],
                        help="a name clients and peers reach nats-server by (repeat; *.x for a wildcard)")
    parser.add_argument("--gateway-host", action="append", default=[], help="a name clients reach the gateway by")
    parser.add_argument("--users-conf", action="store_true",
                        help="print nats-server's authorization block (passwords from its environment) and exit")
    return parser


def main(argv: Sequence[str]) -> int:
    """`kvcentric certs`: the material of a secured deployment (compose, Kubernetes) in a folder."""
    parser = certs_parser()
    args = parser.parse_args(argv)
    if args.users_conf:
        print(users_conf(), end="")
        return 0
    if not args.out:
        parser.error("--out is required")
    files = make_secure_files(args.out, args.gateway_host, args.nats_host)
    print(f"kvcentric certs: wrote the CA, certificates and secrets of a deployment to {files.folder}")
    return 0
