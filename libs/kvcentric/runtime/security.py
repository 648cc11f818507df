"""The TLS and credentials of a service's connections, read from the files its flags name: how it reaches NATS
(`NatsAccess`), the mutual TLS of the KV transfer (`TransferTls`), Redis's password and TLS, the gateway's
HTTPS context and API keys. A file that is missing, unreadable or not what it should be is a ConfigError naming
the flag. It decides nothing about who may do what on the bus (`core/permissions.py`) and makes no certificate
(`tools/certs.py`).
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import ssl
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvcentric.config import KV_SERVER_NAME, ConfigError, flag_name
from kvcentric.core.permissions import inbox_prefix

if TYPE_CHECKING:  # grpc and cryptography are imported where used: the bus-only services never load them
    import grpc

NATS_PASSWORD_VARIABLE = "KVC_NATS_PASSWORD"
REDIS_PASSWORD_VARIABLE = "KVC_REDIS_PASSWORD"


def read_file(path: str, field: str) -> bytes:
    """The bytes of the file that the flag of `field` names; ConfigError naming the flag when it cannot be read."""
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise ConfigError(f"{flag_name(field)} {path}: {exc.strerror or exc}") from None


def read_secret(path: str, field: str) -> str:
    """A password or key kept in a file (its surrounding whitespace dropped); ConfigError when it is empty."""
    secret = read_file(path, field).decode(errors="strict").strip()
    if not secret:
        raise ConfigError(f"{flag_name(field)} {path}: the file is empty")
    return secret


def secret_from(path: str, field: str, variable: str) -> str:
    """The secret in the file `path` (the flag of `field`), else in the environment `variable`, else ""."""
    return read_secret(path, field) if path else os.environ.get(variable, "")


# ---------------------------------------------------------------- TLS contexts


def _load_ca(context: ssl.SSLContext, ca: str, field: str) -> None:
    try:
        context.load_verify_locations(cadata=read_file(ca, field).decode(errors="replace"))
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{flag_name(field)} {ca}: not a PEM CA certificate ({exc})") from None


def _load_pair(context: ssl.SSLContext, cert: str, key: str, cert_field: str, key_field: str) -> None:
    read_file(cert, cert_field)
    read_file(key, key_field)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError(f"{flag_name(cert_field)} {cert} / {flag_name(key_field)} {key}: not a PEM certificate "
                          f"and its private key ({exc.reason or exc})") from None


def client_context(ca: str, cert: str = "", key: str = "") -> ssl.SSLContext:
    """TLS as a client: the server's certificate checked against the CA of --tls-ca (the system's when ""), and
    this service's --tls-cert presented when the server asks for one."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if ca:
        _load_ca(context, ca, "tls_ca")
    if cert:
        _load_pair(context, cert, key, "tls_cert", "tls_key")
    return context


def server_context(cert: str, key: str, cert_field: str, key_field: str) -> ssl.SSLContext:
    """TLS as a server (the gateway's HTTPS): this certificate and key, TLS 1.2 at least, no client certificate."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_pair(context, cert, key, cert_field, key_field)
    return context


# ---------------------------------------------------------------- NATS


@dataclasses.dataclass(frozen=True)
class NatsAccess:
    """Where NATS is and how to get in: its URL, the user and password, the CA and this service's certificate.
    Each connection gets a fresh TLS context (`options`), so a thread with its own event loop may connect too."""

    url: str
    user: str = ""
    password: str = dataclasses.field(default="", repr=False)
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca) or self.url.startswith("tls://")

    def options(self) -> dict[str, Any]:
        """Keyword arguments of `nats.connect` besides the servers."""
        options: dict[str, Any] = {}
        if self.user:
            options.update(user=self.user, password=self.password, inbox_prefix=inbox_prefix(self.user))
        if self.tls:
            options["tls"] = client_context(self.tls_ca, self.tls_cert, self.tls_key)
        return options


def nats_access(config) -> NatsAccess:
    """How the service of `config` (a BusConfig) reaches NATS; the password read from its file or variable."""
    password = secret_from(config.nats_password_file, "nats_password_file", NATS_PASSWORD_VARIABLE) \
        if config.nats_user else ""
    if config.nats_user and not password:
        raise ConfigError(f"--nats-user {config.nats_user}: no password (give --nats-password-file or set "
                          f"{NATS_PASSWORD_VARIABLE})")
    return NatsAccess(config.nats_url, config.nats_user, password, config.tls_ca, config.tls_cert, config.tls_key)


def redact_url(url: str) -> str:
    """`url` without a password in it (nats://user:secret@host -> nats://user:***@host), for a log line."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.partition(':')[0]}:***@{host}"


# ---------------------------------------------------------------- the KV transfer (gRPC)


@dataclasses.dataclass(frozen=True)
class TransferTls:
    """Mutual TLS of the KV transfer: a server takes only clients whose certificate the CA signed, a client only
    a server whose certificate the CA signed for KV_SERVER_NAME."""

    ca: bytes
    cert: bytes
    key: bytes = dataclasses.field(repr=False)

    def server_credentials(self) -> grpc.ServerCredentials:
        import grpc
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    @property
    def channel_options(self) -> list[tuple[str, Any]]:
        """A peer is reached by address; the name its certificate is checked for is KV_SERVER_NAME."""
        return [("grpc.ssl_target_name_override", KV_SERVER_NAME)]


def dns_names(cert_pem: bytes) -> list[str]:
    """The DNS names among a PEM certificate's subject alternative names."""
    from cryptography import x509

    certificate = x509.load_pem_x509_certificate(cert_pem)
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return names.get_values_for_type(x509.DNSName)


def transfer_tls(config) -> TransferTls | None:
    """The KV transfer's mutual TLS from --tls-ca, --tls-cert and --tls-key (None without --tls-cert: plaintext)."""
    if not config.tls_cert:
        return None
    client_context(config.tls_ca, config.tls_cert, config.tls_key)  # each file parses, the key fits the cert
    tls = TransferTls(read_file(config.tls_ca, "tls_ca"), read_file(config.tls_cert, "tls_cert"),
                      read_file(config.tls_key, "tls_key"))
    if KV_SERVER_NAME not in dns_names(tls.cert):
        raise ConfigError(f"--tls-cert {config.tls_cert}: does not name {KV_SERVER_NAME!r} among its DNS names, "
                          "the name KV transfer peers check")
    return tls


def channel(addr: str, tls: TransferTls | None, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
    """A gRPC channel to `addr`: mutual TLS with `tls`, plaintext without."""
    import grpc

    if tls is None:
        return grpc.aio.insecure_channel(addr, options=list(options))
    return grpc.aio.secure_channel(addr, tls.channel_credentials(), options=[*options, *tls.channel_options])


# ---------------------------------------------------------------- Redis


def redis_options(url: str, user: str, password_file: str, tls_ca: str, tls_cert: str, tls_key: str) -> dict:
    """Keyword arguments of `Redis.from_url(url)`: AUTH as `user` (the default user when "") with the password of
    `password_file` or KVC_REDIS_PASSWORD, and with a rediss:// URL the server checked against `tls_ca`."""
    options: dict[str, Any] = {}
    password = secret_from(password_file, "redis_password_file", REDIS_PASSWORD_VARIABLE)
    if password:
        options["password"] = password
    if user:
        options["username"] = user
    if url.startswith("rediss://"):
        if tls_ca:
            read_file(tls_ca, "tls_ca")
            options.update(ssl_ca_certs=tls_ca, ssl_cert_reqs="required")
        if tls_cert:
            read_file(tls_cert, "tls_cert")
            read_file(tls_key, "tls_key")
            options.update(ssl_certfile=tls_cert, ssl_keyfile=tls_key)
    return options


# ---------------------------------------------------------------- the gateway's API keys


def read_api_keys(path: str, field: str = "api_keys_file") -> tuple[str, ...]:
    """The keys of an API keys file: one a line, blank lines and `#` comments skipped; ConfigError when none."""
    keys = tuple(line.strip() for line in read_file(path, field).decode().splitlines()
                 if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ConfigError(f"{flag_name(field)} {path}: holds no key (one a line)")
    return keys


def key_matches(token: str, keys: Iterable[str]) -> bool:
    """Whether `token` is one of `keys`, compared in constant time with each of them (the answer's timing says
    neither which key matched nor how much of one)."""
    presented = token.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(presented, key.encode())
    return found


FILE_FIELDS = ("tls_ca", "tls_cert", "tls_key", "nats_password_file", "redis_password_file", "https_cert",
               "https_key", "api_keys_file")
"""Config fields that name a file a service reads at start."""


def check_files(config) -> None:
    """Read every file `config` names (of FILE_FIELDS) and parse the certificates and keys now, so that a bad one
    stops the command with the flag named, before it connects anywhere."""
    for field in FILE_FIELDS:
        path = getattr(config, field, "")
        if path:
            read_file(path, field)
    if getattr(config, "tls_ca", "") or getattr(config, "tls_cert", ""):
        client_context(config.tls_ca, config.tls_cert, config.tls_key)
    if getattr(config, "tls_cert", "") and hasattr(config, "kv_port"):  # it serves KV: peers check its name
        transfer_tls(config)
    if getattr(config, "nats_user", ""):
        nats_access(config)
    if getattr(config, "https_cert", ""):
        server_context(config.https_cert, config.https_key, "https_cert", "https_key")
    if getattr(config, "api_keys_file", ""):
        read_api_keys(config.api_keys_file)
