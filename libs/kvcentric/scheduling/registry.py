"""What the Conductor knows of the instances: their last load report, plus what it dispatched since.

Pure: time is passed in. An instance is alive while its last report is younger than `stale_after_s`.
"""

from __future__ import annotations

import dataclasses

from kvcentric.protocol import InstanceInfo, LoadReport


@dataclasses.dataclass
class Instance:
    report: LoadReport
    seen_at: float
    dispatched_requests: int = 0
    """Requests sent to it since its last report (not yet visible in a report)."""
    dispatched_tokens: int = 0

    @property
    def instance_id(self) -> str:
        return self.report.instance_id

    @property
    def prefill_load(self) -> float:
        """Tokens waiting to be prefilled there."""
        return self.report.queued_tokens + self.dispatched_tokens

    @property
    def decode_load(self) -> float:
        """Requests decoding or waiting for KV there, and how full its KV cache is as a tiebreak."""
        used = 1.0 - self.report.kv_blocks_free / max(1, self.report.kv_blocks_total)
        return self.report.running + self.report.queued_requests + self.dispatched_requests + used


class InstanceRegistry:
    def __init__(self, stale_after_s: float = 1.5) -> None:
        self.stale_after_s = stale_after_s
        self.instances: dict[str, Instance] = {}

    def observe(self, report: LoadReport, now: float) -> None:
        instance = self.instances.get(report.instance_id)
        if instance is None or instance.report.role != report.role:
            self.instances[report.instance_id] = Instance(report, now)
            return
        instance.report, instance.seen_at = report, now
        instance.dispatched_requests = instance.dispatched_tokens = 0

    def alive(self, role: str, now: float) -> list[Instance]:
        return [i for i in self.instances.values()
                if i.report.role == role and now - i.seen_at <= self.stale_after_s]

    def note_dispatch(self, instance_id: str, tokens: int) -> None:
        instance = self.instances.get(instance_id)
        if instance is not None:
            instance.dispatched_requests += 1
            instance.dispatched_tokens += tokens

    def forget_stale(self, now: float, after_s: float = 60.0) -> None:
        for instance_id in [k for k, i in self.instances.items() if now - i.seen_at > after_s]:
            del self.instances[instance_id]

    def snapshot(self, now: float) -> list[InstanceInfo]:
        return [InstanceInfo(i.instance_id, i.report.role, i.report.cluster, i.report.kv_addr,
                             i.prefill_load if i.report.role == "prefill" else i.decode_load,
                             round(now - i.seen_at, 3))
                for i in self.instances.values() if now - i.seen_at <= self.stale_after_s]
