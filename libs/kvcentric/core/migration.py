"""Request migration (Dynamo's, Llumnix's): when an in-flight request must move to live instances and what
it asks for when it does; it decides, it sends nothing and reads no clock.

A request depends on its prefill instance until its first token and on its decode instance until its last.
When one of those goes silent (no load report, which every engine sends from a heartbeat thread, for
`silent_after_s`) or sends an error chunk that means it failed (5xx), the gateway asks again for a placement
of a *continuation*: the prompt followed by the tokens the client already has, with what is left of
max_tokens. The prefill instance that gets it finds the prompt's blocks in its prefix cache (or pulls them),
and the output's where the decode instance wrote them back (`engine/service/writeback.py`), and computes only the
rest, so the client sees one stream with no token missing or repeated. The
continuation's `SamplingParams.resumed_tokens` tells the engines how many of its prompt tokens were
output (`history`), so penalties, min_tokens and seeded draws go on as if nothing had happened.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from kvcentric.core.protocol import Placement, SamplingParams, TokenChunk

Reason = Literal["decode_silent", "prefill_silent", "engine_error"]
"""Why a request was migrated: the instance it waited on stopped reporting, or an engine failed it."""


class InstanceWatch:
    """When each engine was last heard from (any load report), and which of them have gone silent.

    An instance is silent when it has not been heard for `silent_after_s` *and* others have been heard since
    (by half that), so a gateway whose own event loop stalled, or that lost the bus, takes nobody for dead;
    when nobody at all is heard for three times as long, a silent instance is silent all the same.

    An instance restarted under the same id (its supervisor started it again faster than `silent_after_s`) is
    never silent for long enough: it is known by its reports' heartbeat ticks (`LoadReport.seq`), which a new
    process counts again from 1. What was placed on it before is gone with the process that held it."""

    def __init__(self, silent_after_s: float) -> None:
        self.silent_after_s = silent_after_s
        self.heard: dict[str, float] = {}
        self.reporting: set[str] = set()
        """Instances heard from at least once (their silence means something)."""
        self.latest = -math.inf
        self.ticks: dict[tuple[str, str], int] = {}
        """The latest heartbeat tick of each instance's reports on each of its streams (a colocated instance
        reports as a prefill and as a decode instance, each stream counting its own; 0: they carry none)."""
        self.restarted: dict[str, float] = {}
        """When each instance was last heard from a new process (its ticks began again)."""

    def heard_from(self, instance_id: str, now: float, tick: int = 0, stream: str = "") -> None:
        """A report of `instance_id` (on `stream`, its subject: the ticks of each stream count apart)."""
        if 0 < tick <= self.ticks.get((instance_id, stream), 0):
            self.restarted[instance_id] = now
        if tick:
            self.ticks[instance_id, stream] = tick
        self.heard[instance_id] = now
        self.reporting.add(instance_id)
        self.latest = max(self.latest, now)

    def restarted_since(self, instance_ids: Iterable[str], since: float) -> str | None:
        """The first of these instances heard from a new process after `since` (when a request was placed)."""
        return next((i for i in instance_ids if self.restarted.get(i, -math.inf) > since), None)

    def expect(self, instance_id: str, now: float) -> None:
        """A request was placed on `instance_id`: never heard of yet, it has `silent_after_s` from now."""
        self.heard.setdefault(instance_id, now)

    def silence_s(self, instance_id: str, now: float) -> float:
        """Seconds since the instance was last heard (0 for one never expected)."""
        return now - self.heard.get(instance_id, now)

    def silent(self, instance_id: str, now: float) -> bool:
        last = self.heard.get(instance_id)
        if last is None:
            return False
        quiet = now - last
        others_since = self.latest - last
        return quiet > self.silent_after_s and (others_since > self.silent_after_s / 2
                                                or quiet > 3 * self.silent_after_s)

    def first_silent(self, instance_ids: Iterable[str], now: float) -> str | None:
        return next((i for i in instance_ids if self.silent(i, now)), None)

    def all_heard_since(self, instance_ids: Iterable[str], since: float) -> bool:
        """Every one of them has reported after `since` (each was alive then)."""
        return all(self.heard.get(i, -math.inf) > since for i in instance_ids)

    def deaf(self, now: float) -> bool:
        """Nobody at all has been heard for `silent_after_s`: silence tells nothing now."""
        return now - self.latest > self.silent_after_s


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why a request's current placement cannot finish it."""

    reason: Reason
    message: str
    instance_id: str = ""
    """The instance that failed it, when known (it is not placed on again by this request)."""
    silence_s: float = 0.0
    """For a silent instance: how long it had been silent when that was noticed (the detection time)."""


def waited_on(placement: Placement, tokens_received: int) -> tuple[str, ...]:
    """The instances a request waits on: before its first token its prefill and its decode instance, after
    it the decode instance only (the prefill's part is done)."""
    if tokens_received:
        return (placement.decode_id,)
    return tuple(dict.fromkeys((placement.prefill_id, placement.decode_id)))


def silent_failure(placement: Placement, tokens_received: int, watch: InstanceWatch, now: float,
                   placed_at: float = math.inf) -> Failure | None:
    """The failure of a request whose prefill (before the first token) or decode instance went silent, or was
    restarted since the request was placed there at `placed_at` (the process that held it died: it may have come
    back before it was silent for long)."""
    instances = waited_on(placement, tokens_received)
    restarted = watch.restarted_since(instances, placed_at)
    failed = restarted or watch.first_silent(instances, now)
    if failed is None:
        return None
    reason: Reason = "decode_silent" if failed == placement.decode_id else "prefill_silent"
    if restarted is not None:
        return Failure(reason, f"instance {failed} restarted (its load reports began again)", failed, now - placed_at)
    silence_s = watch.silence_s(failed, now)
    return Failure(reason, f"instance {failed} went silent ({silence_s:.1f} s without a load report)", failed,
                   silence_s)


def chunk_failure(chunk: TokenChunk) -> Failure | None:
    """An error chunk that may mean an instance failed the request (a 5xx: KV lost on the way when a
    peer's stream broke, an instance gone when nobody answers on its subject, a failed step): it does when
    one of the request's instances turns out silent (`culprit_search`). A 429 is overload and goes back to
    the client as it is."""
    if chunk.finish_reason != "error" or chunk.error_status == 429:
        return None
    return Failure("engine_error", chunk.error or "an engine failed the request")


def culprit_search(placement: Placement, tokens_received: int, watch: InstanceWatch, since: float,
                   now: float, placed_at: float = math.inf) -> Failure | None | Literal["wait"]:
    """After an error chunk that came at `since`: the silent instance to blame, "wait" while one may yet
    go silent, or None when none will (every instance the request waits on reported after the chunk, none
    ever reported, or the gateway hears nobody at all)."""
    waiting_on = waited_on(placement, tokens_received)
    silent = silent_failure(placement, tokens_received, watch, now, placed_at)
    if silent is not None:
        return silent
    if not any(i in watch.reporting for i in waiting_on) or watch.deaf(now) or \
            watch.all_heard_since(waiting_on, since):
        return None
    return "wait"


@dataclasses.dataclass(frozen=True)
class MigrationPolicy:
    max_migrations: int = 2
    """Migrations one request may make (0: none; a failure ends it with a 503)."""

    def refusal(self, sampling: SamplingParams, migrations_done: int, tokens_received: int) -> str:
        """Why the request cannot be migrated again, or "" when it can."""
        if migrations_done >= self.max_migrations:
            return f"it was migrated {migrations_done} times already (--max-migrations {self.max_migrations})"
        if sampling.n > 1:
            return "a request with several sequences (n or best_of above 1) is not migrated"
        if tokens_received >= sampling.max_tokens:
            return "it had all its tokens"
        return ""


def continuation(prompt: Sequence[int], received: Sequence[int],
                 sampling: SamplingParams) -> tuple[list[int], SamplingParams]:
    """The prompt and sampling of the request going on after `received` (the tokens the client has, of the
    original request with `prompt` and `sampling`): the prompt followed by them, max_tokens less them, and
    `resumed_tokens` saying how many prompt tokens are output. Prompt logprobs were sent with the first
    token; they are asked for again only when it never came."""
    done = len(received)
    resumed = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - done,
                                      resumed_tokens=sampling.resumed_tokens + done,
                                      prompt_logprobs=sampling.prompt_logprobs if not done else None)
    return [*prompt, *received], resumed


def history(sampling: SamplingParams, prompt: Sequence[int],
            generated: Sequence[int]) -> tuple[Sequence[int], Sequence[int]]:
    """(prompt, output) as the original request saw them: the last `sampling.resumed_tokens` prompt tokens
    of a migrated request were its output. What the sampler counts penalties, min_tokens and seeded steps
    over."""
    resumed = sampling.resumed_tokens
    if not resumed:
        return prompt, generated
    return prompt[:-resumed], [*prompt[-resumed:], *generated]
