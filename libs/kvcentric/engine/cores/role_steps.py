"""Each role's step as a `StepCore` (`step.py`) over the engine that keeps its bookkeeping: a decode batch
(`DecodeSteps`), a prefill pass over chunks of several prompts (`PrefillSteps`), a colocated step of one prompt
chunk and one decode batch (`SplitSteps`) or of both in one pass (`MixedSteps`), and a colocated lane's pass of
prompts (`LanePasses`).

They adapt; they decide nothing the engines did not (the schedules, the failures, the hand-overs are the engines').
What a step needs from outside comes in as hooks: the time, the timer of a split step's two parts, a pass's KV pushes
(`PrefillPass.hooks`), the blocks a decode step filled (`collect`), a test's slowed step, the share of a mixed step's
prompt budget a lane leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from kvcentric.core.protocol import TokenChunk
from kvcentric.engine.cores.colocated import ColocatedEngine
from kvcentric.engine.cores.decode import NO_ROOM, DecodeEngine
from kvcentric.engine.cores.layerkv import LayerKV
from kvcentric.engine.cores.mixed import MixedStep, MixedStepper
from kvcentric.engine.cores.prefill import PrefillChunk, PrefillEngine, PrefillWork
from kvcentric.engine.cores.sequence import DecodeRequest
from kvcentric.engine.cores.step import Computed
from kvcentric.engine.model.llama import LayerHook

Clock = Callable[[], float]
Timed = Callable[..., tuple[Any, float]]
"""`timed(fn, *args)`: fn's result and the seconds it took (`SpeedMeter.timed`)."""


def prompt_chunks(chunks: list[PrefillChunk]) -> list[tuple[int, int]]:
    return [(chunk.end - chunk.start, chunk.start) for chunk in chunks]


def failed_prefill(work: PrefillWork, error: BaseException) -> TokenChunk:
    """A prompt's prefill failed: its last chunk, 429 when its decode instance was full (overload, not failure)."""
    status = 429 if NO_ROOM in str(error) else 500
    return TokenChunk.failed(work.request_id, f"prefill failed: {error}", prompt_tokens=len(work.job.token_ids),
                             status=status)


class DecodeResult(NamedTuple):
    tokens: list[int]
    filled: list[Any]
    """The blocks the step filled with generated tokens' KV (`collect`), for a prefill's pool."""


class DecodeSteps:
    """The decode role's step: the continuous batch's next tokens."""

    def __init__(self, engine: DecodeEngine, collect: Callable[[list[DecodeRequest]], list[Any]] | None = None):
        """`collect`: read the blocks a step filled (in the model thread, after it computed), or None for none."""
        self.engine, self.collect = engine, collect

    def schedule(self) -> tuple[list[DecodeRequest] | None, list[TokenChunk]]:
        batch, failed = self.engine.schedule()
        return batch or None, failed  # none: everything left is preempted and waiting for blocks

    def execute(self, batch: list[DecodeRequest]) -> DecodeResult:
        tokens = self.engine.execute(batch)
        return DecodeResult(tokens, self.collect(batch) if self.collect is not None else [])

    def computed(self, batch: list[DecodeRequest]) -> Computed:
        return Computed((), len(batch), sum(r.context_tokens for r in batch))

    def update(self, batch: list[DecodeRequest], result: DecodeResult) -> list[TokenChunk]:
        return self.engine.update(batch, result.tokens)

    def fail(self, batch: list[DecodeRequest], error: Exception) -> list[TokenChunk]:
        return self.engine.fail_step(batch, f"decode step failed: {error}")

    def release(self, batch: list[DecodeRequest]) -> None:
        pass


@dataclasses.dataclass(slots=True)
class PrefillPass:
    """A prefill step: the chunks scheduled, and those that compute with their layer hooks (the service opens each
    prompt's KV push first: a chunk whose push is gone already is dropped)."""

    scheduled: list[PrefillChunk]
    computing: set[str]
    chunks: list[PrefillChunk]
    hooks: list[LayerHook | None]


class PrefillSteps:
    """The prefill role's step: chunks of as many prompts as --prefill-step-tokens holds in one pass, none of a prompt
    the other thread computes; with LayerKV one chunk, and a new prompt starts only once its layers are placed."""

    def __init__(self, engine: PrefillEngine, step_tokens: int, layerkv: LayerKV | None, clock: Clock,
                 slow_down: Callable[[], None]) -> None:
        """`clock`: the time LayerKV places by; `slow_down`: after each pass, in the model thread (tests)."""
        self.engine, self.step_tokens, self.layerkv = engine, step_tokens, layerkv
        self.clock, self.slow_down = clock, slow_down

    def schedule(self) -> tuple[PrefillPass | None, list[TokenChunk]]:
        chunks = self._chunks()
        if not chunks:
            return None, []
        computing = {chunk.work.request_id for chunk in chunks}
        self.engine.computing |= computing
        return PrefillPass(chunks, computing, chunks, [None] * len(chunks)), []

    def _chunks(self) -> list[PrefillChunk]:
        if self.layerkv is None:
            return self.engine.schedule_step(self.step_tokens)
        now = self.clock()
        chunk = self.engine.schedule() if self.layerkv.admit(self.engine, None, now) else None
        self.layerkv.placed(self.engine, now)
        return [chunk] if chunk is not None else []

    def execute(self, plan: PrefillPass) -> list[int | None]:
        tokens = self.engine.execute_step(plan.chunks, plan.hooks)
        self.slow_down()
        return tokens

    def computed(self, plan: PrefillPass) -> Computed:
        """Every chunk scheduled, those dropped before the pass too: the pass's turn is timed to all of them."""
        return Computed(prompt_chunks(plan.scheduled))

    def update(self, plan: PrefillPass, tokens: list[int | None]) -> list[TokenChunk]:
        """Each chunk's progress; a prompt's last chunk makes it computed (its KV still on its way out)."""
        for chunk in plan.chunks:
            self.engine.update(chunk)
            if chunk.last:
                self.engine.complete(chunk.work)
        return []

    def fail(self, plan: PrefillPass, error: Exception) -> list[TokenChunk]:
        out = []
        for chunk in plan.chunks:
            if self.engine.holds(chunk.work.request_id):
                self.engine.finish(chunk.work)
            out.append(failed_prefill(chunk.work, error))
        return out

    def release(self, plan: PrefillPass) -> None:
        self.engine.computing -= plan.computing


class SplitStep(NamedTuple):
    chunk: PrefillChunk | None
    batch: list[DecodeRequest]


class SplitResult(NamedTuple):
    first: int | None
    tokens: list[int]
    prefill_s: float
    decode_s: float


class SplitSteps:
    """The colocated role's step without --step-tokens: one prefill chunk, then one decode batch, each timed apart."""

    def __init__(self, engine: ColocatedEngine, clock: Clock, timed: Timed) -> None:
        """`clock`: the time requests expire and LayerKV measures by; `timed`: each part timed in the model thread."""
        self.engine, self.clock, self.timed = engine, clock, timed

    def schedule(self) -> tuple[SplitStep | None, list[TokenChunk]]:
        expired = self.engine.decode.expire(self.clock())
        chunk, batch, failed = self.engine.schedule(self.clock())
        return SplitStep(chunk, batch) if chunk is not None or batch else None, expired + failed

    def execute(self, step: SplitStep) -> SplitResult:
        chunk, batch = step
        first, prefill_s = self.timed(self.engine.prefill.execute, chunk) if chunk else (None, 0.0)
        tokens, decode_s = self.timed(self.engine.decode.execute, batch) if batch else ([], 0.0)
        return SplitResult(first, tokens, prefill_s, decode_s)

    def computed(self, step: SplitStep) -> Computed:
        chunks = prompt_chunks([step.chunk]) if step.chunk is not None else ()
        return Computed(chunks, len(step.batch), sum(r.context_tokens for r in step.batch))

    def update(self, step: SplitStep, result: SplitResult) -> list[TokenChunk]:
        return self.engine.update(step.chunk, result.first, step.batch, result.tokens)

    def fail(self, step: SplitStep, error: Exception) -> list[TokenChunk]:
        return self.engine.fail_step(step.chunk, step.batch, f"step failed: {error}")

    def release(self, step: SplitStep) -> None:
        pass


class MixedSteps:
    """The colocated role's step with --step-tokens: the decode batch and prompt chunks in one forward pass."""

    def __init__(self, stepper: MixedStepper, clock: Clock, prompt_share: Callable[[], float]) -> None:
        """`clock`: the time requests expire by; `prompt_share`: the share of its prompt budget the next step takes
        (all of it, but beside a lane: `mixed.lane_prompt_share`)."""
        self.stepper, self.clock, self.prompt_share = stepper, clock, prompt_share
        self.prefill = stepper.engine.prefill

    def schedule(self) -> tuple[MixedStep | None, list[TokenChunk]]:
        expired = self.stepper.engine.decode.expire(self.clock())
        step, failed = self.stepper.schedule(self.prompt_share())
        if step.empty:
            return None, expired + failed
        self.prefill.computing.update(chunk.work.request_id for chunk in step.chunks)
        return step, expired + failed

    def execute(self, step: MixedStep) -> tuple[list[int | None], list[int]]:
        return self.stepper.execute(step)

    def computed(self, step: MixedStep) -> Computed:
        return Computed(prompt_chunks(step.chunks), len(step.batch), sum(r.context_tokens for r in step.batch))

    def update(self, step: MixedStep, result: tuple[list[int | None], list[int]]) -> list[TokenChunk]:
        return self.stepper.update(step, *result)

    def fail(self, step: MixedStep, error: Exception) -> list[TokenChunk]:
        return self.stepper.fail_step(step, f"step failed: {error}")

    def release(self, step: MixedStep) -> None:
        self.prefill.computing.difference_update(chunk.work.request_id for chunk in step.chunks)


class LanePasses:
    """A colocated lane's step: chunks of as many waiting prompts as --step-tokens holds in one pass; a prompt whose
    last chunk it computes is handed to the decode batch of the model thread's next step."""

    def __init__(self, engine: ColocatedEngine, step_tokens: int) -> None:
        self.engine, self.prefill, self.step_tokens = engine, engine.prefill, step_tokens

    def schedule(self) -> tuple[list[PrefillChunk] | None, list[TokenChunk]]:
        chunks = self.prefill.schedule_step(self.step_tokens)
        if not chunks:
            return None, []
        self.prefill.computing.update(chunk.work.request_id for chunk in chunks)
        return chunks, []

    def execute(self, chunks: list[PrefillChunk]) -> list[int | None]:
        return self.prefill.execute_step(chunks, [None] * len(chunks))

    def computed(self, chunks: list[PrefillChunk]) -> Computed:
        return Computed(prompt_chunks(chunks))

    def update(self, chunks: list[PrefillChunk], firsts: list[int | None]) -> list[TokenChunk]:
        out = []
        for chunk, first in zip(chunks, firsts):
            out += self.engine.update(chunk, first, [], [])
        return out

    def fail(self, chunks: list[PrefillChunk], error: Exception) -> list[TokenChunk]:
        out = []
        for chunk in chunks:
            out += self.engine.fail_step(chunk, [], f"step failed: {error}")
        return out

    def release(self, chunks: list[PrefillChunk]) -> None:
        self.prefill.computing.difference_update(chunk.work.request_id for chunk in chunks)
