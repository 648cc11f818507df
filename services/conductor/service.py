"""The conductor's asyncio shell: feeds load reports into the registry and answers schedule requests
with the Conductor core's decision. All policy is in `kvcentric.scheduling`.
"""

from __future__ import annotations

import time

from kvc_conductor.config import ConductorConfig
from kvcentric.protocol import InstancesQuery, InstancesReply, LoadReport, Rejection, ScheduleRequest, Subjects
from kvcentric.scheduling.conductor import Conductor
from kvcentric.scheduling.registry import InstanceRegistry
from kvcentric.service import Service


class ConductorService(Service):
    role = "conductor"

    def __init__(self, config: ConductorConfig) -> None:
        super().__init__(config)
        self.registry = InstanceRegistry(config.stale_after_s)
        self.core = Conductor(self.registry)

    async def start(self) -> None:
        await self.subscribe(Subjects.LOAD_ALL, LoadReport, self.on_load)
        await self.subscribe(Subjects.SCHEDULE, ScheduleRequest, self.on_schedule, queue="conductor",
                             bad_reply=lambda error: Rejection("", "bad_request", error, 0.0))
        await self.subscribe(Subjects.INSTANCES, InstancesQuery, self.on_instances,
                             bad_reply=lambda error: self.instances())

    async def on_load(self, report: LoadReport) -> None:
        self.registry.observe(report, time.monotonic())

    async def on_schedule(self, request: ScheduleRequest):
        decision = self.core.schedule(request, time.monotonic())
        self.counters[f"schedule_{type(decision).__name__.lower()}_total"] += 1
        return decision

    async def on_instances(self, query: InstancesQuery) -> InstancesReply:
        return self.instances(query.role)

    def instances(self, role: str = "") -> InstancesReply:
        snapshot = self.registry.snapshot(time.monotonic())
        return InstancesReply([i for i in snapshot if not role or i.role == role])

    def health(self) -> dict:
        now = time.monotonic()
        return {"prefill_alive": len(self.registry.alive("prefill", now)),
                "decode_alive": len(self.registry.alive("decode", now))}
