"""Frozen config dataclasses that become command-line flags with matching environment variables.

A field `nats_url` becomes the flag `--nats-url` and the variable `KVC_NATS_URL`; the flag wins over
the variable, the variable over the default. Validation errors name the flag at fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import typing
from typing import Any, Literal, get_args, get_origin

KV_SERVER_NAME = "kvcentric-kv"
"""The name a KV transfer peer's certificate must carry: peers reach each other by address (a pod IP), so every
certificate of the deployment names this one instead, and a client checks it (`runtime/security.py`)."""

LogLevel = Literal["debug", "info", "warning", "error"]
"""Log levels every service and `kvcentric up` take."""


class ConfigError(ValueError):
    """A bad setting; the message names the flag."""


def setting(default: Any, help: str) -> Any:
    """A config field with its help text (shown by --help together with its env variable)."""
    return dataclasses.field(default=default, metadata={"help": help})


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return "KVC_" + name.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """The fields' types, the string annotations (`from __future__ import annotations`) evaluated once for the
    class: evaluating all of them per field made a service's flags cost 0.6 s of CPU at every process start."""
    return typing.get_type_hints(cls)


def _converter(kind: Any):
    if get_origin(kind) is Literal:
        return str
    if kind is bool:
        return _parse_bool
    if kind in (int, float, str):
        return kind
    raise TypeError(f"unsupported config type {kind!r}")


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of the config dataclass `cls`; defaults come from the environment."""
    types = _field_types(cls)
    for field in dataclasses.fields(cls):
        kind = types[field.name]
        env = env_name(field.name)
        default = field.default
        help_text = f"{field.metadata.get('help', '')} [env {env}; default: %(default)s]"
        kwargs: dict[str, Any] = {"dest": field.name, "help": help_text, "default": default}
        if get_origin(kind) is Literal:
            kwargs["choices"] = list(get_args(kind))
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _converter(kind)
            kwargs["metavar"] = field.name.upper() if "choices" not in kwargs else None
        if env in os.environ:
            try:
                kwargs["default"] = _converter(kind)(os.environ[env])
            except ValueError as exc:
                raise ConfigError(f"{env} (for {flag_name(field.name)}): {exc}") from exc
        parser.add_argument(flag_name(field.name), **kwargs)


def from_namespace(cls: type, namespace: argparse.Namespace):
    """Build the frozen config from parsed flags; dataclass __post_init__ validates."""
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)}
    return cls(**values)


def require(condition: bool, field: str, message: str) -> None:
    """Raise ConfigError naming the flag of `field` unless `condition` holds."""
    if not condition:
        raise ConfigError(f"{flag_name(field)}: {message}")


@dataclasses.dataclass(frozen=True)
class BusConfig:
    """Settings every service shares: where the bus is, who it is, where its HTTP side listens."""

    nats_url: str = setting("nats://127.0.0.1:4222", "NATS server URL")
    instance_id: str = setting("", "instance id, unique in the cluster (default: role-<random>)")
    cluster: str = setting("local", "cluster (datacenter) this service belongs to")
    host: str = setting("127.0.0.1", "address the HTTP side (health, metrics, API) binds to")
    port: int = setting(0, "HTTP port for /health, /ready and /metrics (0: pick a free port)")
    log_level: LogLevel = setting("info", "log level")
    port_file: str = setting("", "once the HTTP side listens, write the port bound and this pid to this file as JSON "
                                 "(for a supervisor that starts services with --port 0)")
    tls_ca: str = setting("", "PEM file of the deployment's CA: the NATS server's certificate is checked against "
                              "it, and with --tls-cert the KV transfer (gRPC) takes only peers it signed")
    tls_cert: str = setting("", "PEM certificate of this service, signed by --tls-ca: presented to NATS (when it asks) "
                                "and to KV transfer peers, and served on this service's KV port (mutual TLS); it "
                                f"must name {KV_SERVER_NAME!r} among its DNS names")
    tls_key: str = setting("", "PEM private key of --tls-cert")
    nats_user: str = setting("", "NATS user to connect as; its password comes from --nats-password-file, else from "
                                 "the variable KVC_NATS_PASSWORD (no flag: a command line is visible to every user)")
    nats_password_file: str = setting("", "file holding the password of --nats-user")

    def __post_init__(self) -> None:
        require(self.nats_url.startswith(("nats://", "tls://", "ws://", "wss://")), "nats_url",
                f"expected nats://host:port, got {self.nats_url!r}")
        require(0 <= self.port < 65536, "port", f"must be 0..65535, got {self.port}")
        require("." not in self.instance_id and " " not in self.instance_id, "instance_id",
                "may not contain '.' or spaces (it is part of NATS subjects)")
        require(bool(self.tls_cert) == bool(self.tls_key), "tls_key" if self.tls_cert else "tls_cert",
                "--tls-cert and --tls-key go together")
        require(not self.tls_cert or bool(self.tls_ca), "tls_ca", "--tls-cert needs the CA that signed its peers")
        require(not self.nats_password_file or bool(self.nats_user), "nats_user",
                "--nats-password-file needs the user it is the password of")
