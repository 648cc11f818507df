"""Settings of the messenger service (flags and KVC_* environment variables)."""

from __future__ import annotations

import dataclasses

from kvcentric.config import BusConfig, require, setting


@dataclasses.dataclass(frozen=True)
class MessengerConfig(BusConfig):
    kv_host: str = setting("127.0.0.1", "address the gRPC server binds to")
    kv_port: int = setting(50051, "gRPC port (0: pick a free port)")
    capacity_mb: int = setting(1024, "host memory for stored KV, in MiB")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.kv_port < 65536, "kv_port", "must be 0..65535")
        require(self.capacity_mb > 0, "capacity_mb", "must be positive")
