"""Settings of the conductor service (flags and KVC_* environment variables)."""

from __future__ import annotations

import dataclasses

from kvcentric.config import BusConfig, require, setting


@dataclasses.dataclass(frozen=True)
class ConductorConfig(BusConfig):
    stale_after_s: float = setting(1.5, "an instance with no load report for this long is out of placement")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.stale_after_s > 0, "stale_after_s", "must be positive")
