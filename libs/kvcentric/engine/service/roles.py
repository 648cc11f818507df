"""The role change of PrfaaS §3.4.3: a `RoleSwitch` on kvc.control.<id> is answered at once; the instance
then drains (reporting itself draining, so the conductor stops placing on it), announces its cached blocks
gone, and stops, and the process goes on as the other role's service with the same model, id and ports.

It decides and sequences the change; the work that drains is the role's, and so is what "idle" means.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from kvcentric.core.protocol import RoleSwitch, Subjects, SubmitAck
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.registry import service_class
from kvcentric.runtime.bus import Bus
from kvcentric.runtime.tasks import Tasks

DRAIN_GRACE_S = 0.5
"""A draining instance still takes what was placed before the conductor saw its draining report."""
DRAIN_POLL_S = 0.05
SWITCHING_ROLES = ("prefill", "decode")
"""The roles an instance may switch between (a colocated instance serves both already)."""


class RoleChange:
    """`idle`: nothing queued, running, in transfer or still to send; `report_load` publishes the load now;
    `forget_cache` announces the cached blocks gone."""

    def __init__(self, role: str, tasks: Tasks, counters: collections.Counter[str], log: logging.Logger,
                 idle: Callable[[], bool], report_load: Callable[[], Awaitable[None]],
                 forget_cache: Callable[[], Awaitable[None]]) -> None:
        self.role, self.tasks, self.counters, self.log = role, tasks, counters, log
        self.idle, self.report_load, self.forget_cache = idle, report_load, forget_cache
        self.draining_to: str | None = None
        """The role this instance is draining to, while a role change is under way."""
        self.next_role: str | None = None
        """Set when the drain is done: the process goes on as this role (`successor`)."""

    async def listen(self, bus: Bus, instance_id: str) -> None:
        await bus.subscribe(Subjects.control(instance_id), RoleSwitch, self.on_switch,
                            bad_reply=lambda error: SubmitAck(ok=False, error=error))

    def answer(self, command: RoleSwitch) -> SubmitAck | None:
        """The ack of a command that starts no drain, or None when it starts one."""
        if self.role not in SWITCHING_ROLES:
            return SubmitAck(ok=False, error=f"a {self.role} instance serves both roles; it does not switch")
        if command.role == self.role and self.draining_to is None:
            return SubmitAck(ok=True, error=f"already a {self.role} instance")
        if self.draining_to is not None:
            return SubmitAck(ok=self.draining_to == command.role, error=f"already draining to {self.draining_to}")
        return None

    async def on_switch(self, command: RoleSwitch) -> SubmitAck:
        """Drain, then serve as `command.role`; answered at once (the drain goes on in the background)."""
        ack = self.answer(command)
        if ack is not None:
            return ack
        self.draining_to = command.role
        self.counters["role_switches_total"] += 1
        self.log.info("draining to become a %s instance%s", command.role,
                      f" ({command.reason})" if command.reason else "")
        await self.report_load()  # the conductor stops placing here now, not at the next tick
        self.tasks.spawn(self.drain_then_switch(), "role-switch")
        return SubmitAck(ok=True)

    @property
    def draining(self) -> bool:
        return self.draining_to is not None

    async def drain_then_switch(self) -> None:
        started = time.monotonic()
        while not (self.idle() and time.monotonic() - started >= DRAIN_GRACE_S):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.tasks.stopping.wait(), DRAIN_POLL_S)
            if self.tasks.stopping.is_set():
                return  # shutting down: no switch
        await self.forget_cache()
        self.log.info("drained in %.2f s; switching to %s", time.monotonic() - started, self.draining_to)
        self.next_role = self.draining_to
        self.tasks.stopping.set()

    def successor(self, config: EngineConfig, instance_id: str, runner: ModelRunner):
        """The service this process runs next: the other role on the same model, same id and ports."""
        if self.next_role is None:
            return None
        return service_class(self.next_role)(dataclasses.replace(config, instance_id=instance_id), runner)
