"""How an engine takes jobs and cancels from NATS: a job that is malformed, or whose request was cancelled
before it came, is refused in its ack; every cancel is remembered for a while so that can be told.

It checks and forwards; what a job or a cancel does is the role's handler.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvcentric.core.protocol import Cancel, DecodeJob, PrefillJob, Subjects, SubmitAck, job_problem
from kvcentric.runtime.bus import Bus

CANCELLED_REMEMBERED = 4096
"""How many cancelled request ids an engine remembers, to refuse a job that comes after its cancel."""

Job = TypeVar("Job", PrefillJob, DecodeJob)


class JobIntake:
    """Jobs on kvc.<role>.<id>.submit and cancels on kvc.req.cancel; `request_id in intake` says whether
    the request was cancelled lately."""

    def __init__(self, counters: collections.Counter[str]) -> None:
        self.counters = counters
        self.cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
        """The last CANCELLED_REMEMBERED request ids cancelled: a job that arrives after its cancel (the
        conductor dispatches it while the gateway, a different sender, cancels) is refused."""

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.cancelled

    def cancel(self, request_id: str) -> None:
        self.cancelled[request_id] = None
        if len(self.cancelled) > CANCELLED_REMEMBERED:
            self.cancelled.popitem(last=False)

    def refusal(self, job: PrefillJob | DecodeJob) -> SubmitAck | None:
        """The ack refusing `job`, or None when it may go to the role's handler."""
        problem = job_problem(job.request_id, job.sampling)
        if problem:
            self.counters["bus_drops_total"] += 1
            return SubmitAck(ok=False, error=problem)
        if job.request_id in self.cancelled:
            self.counters["jobs_after_cancel_total"] += 1
            return SubmitAck(ok=False, error=f"request {job.request_id} was cancelled before its job arrived")
        return None

    async def take_jobs(self, bus: Bus, role: str, instance_id: str, kind: type[Job],
                        handler: Callable[[Job], Awaitable[SubmitAck]]) -> None:
        """Take `kind` jobs on kvc.<role>.<id>.submit with `handler`, unless refused."""
        async def take(job: Job) -> SubmitAck:
            return self.refusal(job) or await handler(job)

        await bus.subscribe(Subjects.submit(role, instance_id), kind, take,
                            bad_reply=lambda error: SubmitAck(ok=False, error=error))

    async def take_cancels(self, bus: Bus, handler: Callable[[Cancel], Awaitable[None]]) -> None:
        """Remember each cancel, then hand it to `handler`."""
        async def take(cancel: Cancel) -> None:
            self.cancel(cancel.request_id)
            await handler(cancel)

        await bus.subscribe(Subjects.CANCEL_ALL, Cancel, take)
