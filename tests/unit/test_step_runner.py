"""A role's step as one shape (`engine/cores/step.py`, `role_steps.py`) run by `StepRunner` (`engine/service/steps.py`):
a step updates its core and hands back its chunks; a step whose execute raises fails only its plan's requests and the
next step runs; a plan whose I/O leaves nothing to compute is released without computing; colocated split and mixed
steps through the runner generate what the engines' own steps generate; a pass's seconds are shared by tokens."""

from __future__ import annotations

import asyncio
import time

import pytest

from factories import colocated_with_prompts, greedy
from kvcentric.core.protocol import TokenChunk
from kvcentric.engine.cores.mixed import MixedStepper
from kvcentric.engine.cores.role_steps import MixedSteps, SplitSteps
from kvcentric.engine.cores.step import Computed, token_shares
from kvcentric.engine.service.steps import StepRunner


async def inline(fn, *args):
    """An executor that computes in the event loop's thread (the model thread's stand-in)."""
    return fn(*args)


def timed(fn, *args):
    return fn(*args), 0.25


class Core:
    """A core whose plans are request ids and whose execute raises for those named in `broken`."""

    def __init__(self, plans: list[str], broken: frozenset[str] = frozenset()) -> None:
        self.plans, self.broken = plans, broken
        self.released: list[str] = []
        self.updated: list[str] = []

    def schedule(self):
        return (self.plans.pop(0) if self.plans else None), []

    def execute(self, plan: str) -> int:
        if plan in self.broken:
            raise RuntimeError("out of memory")
        return 7

    def computed(self, plan: str) -> Computed:
        return Computed(((3, 0),))

    def update(self, plan: str, result: int) -> list[TokenChunk]:
        self.updated.append(plan)
        return [TokenChunk(request_id=plan, seq=0, token_ids=[result])]

    def fail(self, plan: str, error: Exception) -> list[TokenChunk]:
        return [TokenChunk.failed(plan, f"step failed: {error}", prompt_tokens=3)]

    def release(self, plan: str) -> None:
        self.released.append(plan)


def test_a_step_updates_its_core_and_hands_back_its_chunks_timed_where_asked():
    core = Core(["r1"])
    runner = StepRunner(core, inline, timed)
    out = runner.schedule()
    assert not out.idle and out.chunks == [] and out.started <= time.perf_counter()
    asyncio.run(runner.run(out))
    assert [c.token_ids for c in out.chunks] == [[7]] and out.result == 7 and out.error is None
    assert out.seconds == 0.25 and out.computed == Computed(((3, 0),))
    assert core.released == ["r1"] and core.updated == ["r1"]
    assert runner.schedule().idle


def test_a_failing_step_fails_only_its_plan_and_the_next_step_runs():
    core = Core(["r1", "r2"], broken={"r1"})
    runner = StepRunner(core, inline)
    failed = asyncio.run(runner.run(runner.schedule()))
    assert isinstance(failed.error, RuntimeError) and failed.result is None
    assert [(c.request_id, c.finish_reason) for c in failed.chunks] == [("r1", "error")]
    assert core.updated == [] and core.released == ["r1"]
    served = asyncio.run(runner.run(runner.schedule()))
    assert served.error is None and [c.request_id for c in served.chunks] == ["r2"]


def test_a_plan_whose_io_leaves_nothing_to_compute_is_released_without_computing():
    core = Core(["r1"], broken={"r1"})  # computing it would raise

    async def nothing_left(plan: str) -> bool:
        return False

    runner = StepRunner(core, inline)
    out = asyncio.run(runner.run(runner.schedule(), nothing_left))
    assert out.chunks == [] and out.error is None and out.result is None
    assert core.released == ["r1"] and out.computed == Computed(((3, 0),))  # its turn is still timed


@pytest.mark.parametrize("mixed", [False, True])
def test_colocated_steps_through_the_runner_generate_what_the_engine_alone_does(mixed):
    params = greedy(6)
    engine, expected = colocated_with_prompts(params)
    core = MixedSteps(MixedStepper(engine, 16), time.monotonic, lambda: 1.0) if mixed else \
        SplitSteps(engine, time.monotonic, timed)
    steps = StepRunner(core, inline, timed if mixed else None)
    out: dict[str, list[int]] = {f"c{i}": [] for i in range(3)}

    async def serve() -> None:
        while engine.has_work:
            step = steps.schedule()
            if not step.idle:
                await steps.run(step)
                assert step.error is None and (step.computed.chunks or step.computed.rows)
            for chunk in step.chunks:
                out[chunk.request_id] += chunk.token_ids

    asyncio.run(serve())
    assert [out[f"c{i}"] for i in range(3)] == expected
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.prefill.computing


def test_a_pass_is_timed_to_its_prompt_chunks_and_decode_rows_by_tokens():
    shares, decode_s = token_shares(1.0, Computed(((30, 0), (10, 64)), rows=10, kv_tokens=500))
    assert shares == pytest.approx([0.6, 0.2]) and decode_s == pytest.approx(0.2)
    assert token_shares(0.5, Computed((), rows=4, kv_tokens=40)) == ([], 0.5)  # decode rows alone: all of it
    shares, decode_s = token_shares(0.5, Computed(((8, 0),)))
    assert shares == [0.5] and decode_s == 0.0
