"""An engine step as values: `StepCore`, the four verbs every role's core offers (schedule, execute, update, fail),
and `StepOutput`, what one step gave (the chunks to emit, what it computed, how it ended).

It says what a step is; it does not run one. `engine/service/steps.py` runs the verbs, in the model thread or a
lane, and the services move the output's chunks and cache changes out. No threads, no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Generic, NamedTuple, Protocol, TypeVar

from kvcentric.core.protocol import TokenChunk

P = TypeVar("P")
R = TypeVar("R")


class Computed(NamedTuple):
    """What a step computed, as the speed model counts it: each prompt chunk's (new tokens, tokens before it), and
    the decode batch's rows and the KV tokens they read."""

    chunks: Sequence[tuple[int, int]] = ()
    rows: int = 0
    kv_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(new for new, _ in self.chunks)


class StepCore(Protocol[P, R]):
    """A role's step as nano-vllm's engine reads it (schedule, execute, update), with the plan a value as vLLM's
    `SchedulerOutput` is. Only `execute` touches torch; it runs in whatever thread the runner's executor gives."""

    def schedule(self) -> tuple[P | None, list[TokenChunk]]:
        """The next step's plan (None: nothing to compute now), and the chunks scheduling ended (failures)."""
        ...

    def execute(self, plan: P) -> R:
        """Compute the plan (in the model thread or a lane)."""
        ...

    def computed(self, plan: P) -> Computed:
        """What the plan computes, read before `update` moves its sequences on."""
        ...

    def update(self, plan: P, result: R) -> list[TokenChunk]:
        """Record what `execute` computed; the chunks the step produced."""
        ...

    def fail(self, plan: P, error: Exception) -> list[TokenChunk]:
        """`execute` raised: end only the plan's requests (the engine serves on); their last chunks."""
        ...

    def release(self, plan: P) -> None:
        """The plan is computed no longer (it ran, failed, or was dropped before it ran): what scheduling held for it
        while it computed (the prompts a second thread must not take) is let go."""
        ...


@dataclasses.dataclass(slots=True)
class StepOutput(Generic[P, R]):
    """One step, filled in as it goes: after scheduling, `chunks` are those scheduling ended (to emit before the
    step computes); after it ran, those it produced."""

    plan: P | None
    """None: there was nothing to compute."""
    chunks: list[TokenChunk]
    started: float
    """`time.perf_counter()` before scheduling: where a step's whole turn, as the tokens' gaps see it, begins."""
    result: R | None = None
    error: Exception | None = None
    """What `execute` raised (the plan's requests failed; `chunks` are their last)."""
    computed: Computed = Computed()
    seconds: float = 0.0
    """`execute`'s own time in the model thread, where the runner timed it."""

    @property
    def idle(self) -> bool:
        return self.plan is None


def token_shares(seconds: float, computed: Computed) -> tuple[list[float], float]:
    """A pass's seconds shared by tokens between what it computed: each prompt chunk's share, and the decode rows'
    (one token each). A pass of prompts alone, or of decode rows alone, gives its own kind all of it."""
    tokens = computed.prompt_tokens + computed.rows
    if not computed.chunks:
        return [], seconds
    shares = [seconds * new / tokens for new, _ in computed.chunks]
    return shares, seconds * computed.rows / tokens
