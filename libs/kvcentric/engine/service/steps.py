"""How a role's steps run: `StepRunner` takes a `StepCore` (`engine/cores/step.py`) through schedule, execute on an
executor (the model thread's `ModelThread.run`, or its lane's `run_lane`), then update or fail, and hands back the
`StepOutput`; beside it the small policies the loops consult between steps: when a lane takes prompts
(`PrefillLaneGate`, `ColocatedLaneGate`) and how a decode lends its core between steps (`Pacer`).

It runs steps; it does not emit their chunks, publish cache changes, push KV or time the speed model (the services
do, from the output).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sized
from typing import Any, Generic

from kvcentric.engine.cores.mixed import lane_prompt_share
from kvcentric.engine.cores.prefill import PrefillEngine
from kvcentric.engine.cores.step import P, R, StepCore, StepOutput
from kvcentric.engine.service.coreshare import CoreShare
from kvcentric.engine.service.node import ModelThread, Wakeup

Executor = Callable[..., Awaitable[Any]]
"""`await executor(fn, *args)`: fn(*args) in a model thread (`ModelThread.run`, `ModelThread.run_lane`)."""
Timed = Callable[..., tuple[Any, float]]

LANE_LOOK_S = 0.005
"""How often, while the model thread computes a step, a prefill's lane looks for a lent core and a queued prompt."""


class StepRunner(Generic[P, R]):
    """One role's steps on one executor. `schedule` and `run` are apart so a service may move I/O between them (the
    chunks scheduling ended go out before the step computes; a prefill opens its pushes, `run`'s `prepare`)."""

    def __init__(self, core: StepCore[P, R], executor: Executor, timed: Timed | None = None) -> None:
        """`timed`: run `execute` through it in the executor's thread (`SpeedMeter.timed`), its seconds the output's."""
        self.core, self.executor, self.timed = core, executor, timed

    def schedule(self) -> StepOutput[P, R]:
        started = time.perf_counter()
        plan, chunks = self.core.schedule()
        return StepOutput(plan, chunks, started)

    async def run(self, out: StepOutput[P, R],
                  prepare: Callable[[P], Awaitable[bool]] | None = None) -> StepOutput[P, R]:
        """Compute the scheduled plan, then update the core (or fail the plan's requests alone: the service serves
        on); `prepare` first, when given: the I/O the plan needs before it computes, False when nothing is left to."""
        plan = out.plan
        assert plan is not None
        try:
            if prepare is not None and not await prepare(plan):
                out.chunks, out.computed = [], self.core.computed(plan)
                return out
            try:
                if self.timed is None:
                    result = await self.executor(self.core.execute, plan)
                else:
                    result, out.seconds = await self.executor(self.timed, self.core.execute, plan)
            except Exception as exc:  # noqa: BLE001 - the step's requests fail, the service lives on
                out.error, out.computed = exc, self.core.computed(plan)
                out.chunks = self.core.fail(plan, exc)
                return out
        finally:
            self.core.release(plan)
        out.result, out.computed = result, self.core.computed(plan)
        out.chunks = self.core.update(plan, result)
        return out


class PrefillLaneGate:
    """When a prefill instance's lane (`node.Lane`) takes a prompt: while the model thread computes one (`begin` ..
    `end`), another is queued, and a core is lent."""

    def __init__(self, queue: Sized, share: CoreShare | None) -> None:
        self.queue, self.share = queue, share
        self.model_step = asyncio.Event()

    def begin(self) -> None:
        self.model_step.set()

    def end(self) -> None:
        self.model_step.clear()

    def may_start(self) -> bool:
        return (self.model_step.is_set() and bool(self.queue) and self.share is not None
                and self.share.threads() > 1)

    async def wait(self) -> None:
        """Until the model thread starts a step; then a look every LANE_LOOK_S while it computes (a core lent comes
        with no event)."""
        if not self.model_step.is_set():
            try:
                await asyncio.wait_for(self.model_step.wait(), 0.5)
            except TimeoutError:
                pass
            return
        await asyncio.sleep(LANE_LOOK_S)


class ColocatedLaneGate:
    """When a colocated instance's lane takes prompts: while the model thread computes a mixed step with prompt
    chunks (`begin` .. `end`) and more prompt tokens wait than its next step takes; and the share of its prompt
    budget that next step takes beside the lane."""

    def __init__(self, prefill: PrefillEngine, step_tokens: int, model: ModelThread) -> None:
        """`model`: the model thread, and its lane once the instance has one."""
        self.prefill, self.step_tokens, self.model = prefill, step_tokens, model
        self.model_step = asyncio.Event()
        self.wake = Wakeup()
        """Set when a prompt is queued and when a mixed step with prompt chunks starts: the lane looks then."""

    def begin(self) -> None:
        self.model_step.set()
        self.wake.set()

    def end(self) -> None:
        self.model_step.clear()

    def may_start(self) -> bool:
        return self.model_step.is_set() and self.prompts_waiting()

    def prompts_waiting(self) -> bool:
        """More prompt tokens wait (queued, or in progress and not computed now) than the next mixed step takes:
        fewer, and that step computes them on both threads."""
        return self.prefill.waiting_tokens > self.step_tokens

    async def wait(self) -> None:
        await self.wake.sleep(0.5)  # no polling: a wake-up mid-step would stall the model's team

    def prompt_share(self) -> float:
        """The share of its prompt budget the model thread's next mixed step takes (`lane_prompt_share`)."""
        lane = self.model.lane
        if lane is None:
            return 1.0
        return lane_prompt_share(self.step_tokens, self.model.threads, lane.computing, self.prefill.waiting_tokens)


class Pacer:
    """How a decode lends its core between steps: while an instance beside it computes (a prefill, on the cores lent
    between them, with `behind` prompts queued), it starts steps no more often than `pace_s()`, so the time between
    them is lent to it (`engine/service/coreshare.py`)."""

    def __init__(self, share: CoreShare | None, lend_pace_s: float, pace_s: Callable[[], float],
                 behind: int) -> None:
        self.share, self.lend_pace_s, self.pace_s, self.behind = share, lend_pace_s, pace_s, behind

    async def pace(self, started: float) -> None:
        """After a step that began at `started` (`time.perf_counter()`): wait out the rest of its period, if pacing."""
        share = self.share
        if share is None or self.lend_pace_s <= 0 or not share.taker_behind(self.behind):
            return
        rest = started + self.pace_s() - time.perf_counter()
        if rest > 0.001:
            share.pause(time.monotonic_ns() + int(rest * 1e9))
            await asyncio.sleep(rest)
