"""Settings of the kvs-meta service (flags and KVC_* environment variables)."""

from __future__ import annotations

import dataclasses

from kvcentric.config import BusConfig, require, setting


def sentinel_address(entry: str) -> tuple[str, int] | None:
    """("host", port) of one entry of --redis-sentinels; None where it is not host:port."""
    host, _, port = entry.strip().rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


@dataclasses.dataclass(frozen=True)
class KVSMetaConfig(BusConfig):
    redis_url: str = setting("redis://127.0.0.1:6379/0", "Redis URL of the metadata store (rediss://: over TLS, "
                                                         "the server checked against --tls-ca)")
    redis_user: str = setting("", "Redis ACL user to AUTH as (default: Redis's default user)")
    redis_password_file: str = setting("", "file holding the Redis password (AUTH); else the variable "
                                           "KVC_REDIS_PASSWORD, else no AUTH")
    redis_sentinels: str = setting("", "host:port,host:port,... of Redis Sentinels: kvs-meta asks them which server is "
                                       "the primary of --redis-master (again after a failover); --redis-url then gives "
                                       "only the scheme and the db. Sentinels take the same password and TLS as Redis")
    redis_master: str = setting("kvcentric", "with --redis-sentinels: the name the Sentinels monitor the primary by")
    max_query_keys: int = setting(4096, "most keys one batch query may ask for")
    lease_ttl_s: float = setting(5.0, "a node whose load reports (its heartbeat) stop for this long is purged "
                                      "from every block it held")
    startup_grace_s: float = setting(10.0, "no node is purged in this many seconds after kvs-meta starts or its "
                                           "Redis comes back (their leases lapsed while nobody renewed them; the "
                                           "live ones renew theirs meanwhile)")
    snapshot_timeout_s: float = setting(2.0, "how long to wait for an engine's block lists when its digest "
                                             "differs from the index")


    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.redis_url.startswith(("redis://", "rediss://", "unix://")), "redis_url",
                f"expected redis://host:port/db, got {self.redis_url!r}")
        require(not self.redis_sentinels or all(self.sentinels), "redis_sentinels",
                f"expected host:port,host:port, got {self.redis_sentinels!r}")
        require(not self.redis_sentinels or bool(self.redis_master), "redis_master", "needed with --redis-sentinels")
        require(self.max_query_keys > 0, "max_query_keys", "must be positive")
        require(self.lease_ttl_s > 0, "lease_ttl_s", "must be positive")
        require(self.startup_grace_s >= 0, "startup_grace_s", "must be >= 0")
        require(self.snapshot_timeout_s > 0, "snapshot_timeout_s", "must be positive")

    @property
    def sentinels(self) -> list[tuple[str, int] | None]:
        """The Sentinels of --redis-sentinels as (host, port); None for an entry that is not host:port."""
        return [sentinel_address(entry) for entry in self.redis_sentinels.split(",")] if self.redis_sentinels else []
