"""Health gating of the KV metadata service (Llumnix's kvsRetryTimes / kvsRetryIntervalMs /
kvsMetadataServiceDownDuration): after that many consecutive failed lookups it is marked down and not
asked for a while, and placement goes load-only. Pure bookkeeping with time passed in; it does no I/O.
"""

from __future__ import annotations


class KVSGate:
    def __init__(self, retry_times: int = 5, retry_interval_s: float = 0.1, down_duration_s: float = 30.0) -> None:
        if retry_times < 1:
            raise ValueError("retry_times must be at least 1")
        self.retry_times = retry_times
        self.retry_interval_s = retry_interval_s
        self.down_duration_s = down_duration_s
        self.consecutive_failures = 0
        self.down_until = float("-inf")
        self.times_marked_down = 0

    def available(self, now: float) -> bool:
        """Whether to ask the metadata service now (it is not in a down period)."""
        return now >= self.down_until

    def is_down(self, now: float) -> bool:
        return not self.available(now)

    def on_success(self) -> None:
        self.consecutive_failures = 0

    def on_failure(self, now: float) -> bool:
        """Count a failed attempt; True when this one marks the service down (stop retrying)."""
        self.consecutive_failures += 1
        if self.consecutive_failures < self.retry_times:
            return False
        self.consecutive_failures = 0
        self.down_until = now + self.down_duration_s
        self.times_marked_down += 1
        return True
