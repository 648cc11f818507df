"""Waiting in tests: poll until a condition holds, or read a stream until a line shows up, and fail with
what was awaited and the last thing seen; it never sleeps a fixed time in place of a condition."""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any
from collections.abc import Callable

NOT_YET = object()
"""What `last` says before the probe has answered once."""
SHOWN_CHARS = 2000
"""How much of the last value seen a failure shows."""


class NeverHappened(AssertionError):
    """A wait ran out: the message names what was awaited, why it stopped and the last value seen."""

    def __init__(self, what: str, why: str, last: Any) -> None:
        seen = "nothing" if last is NOT_YET else repr(last)
        if len(seen) > SHOWN_CHARS:
            seen = seen[:SHOWN_CHARS] + f"... ({len(seen)} characters)"
        super().__init__(f"never happened: {what} ({why}); last seen: {seen}")


def eventually(probe: Callable[[], Any], what: str, *, until: Callable[[Any], bool] = bool,
               timeout_s: float = 15.0, every_s: float = 0.05, ignoring: tuple = ()) -> Any:
    """Call `probe` every `every_s` until `until(value)` holds and return that value.

    An exception of a type in `ignoring` counts as "not yet" (and is what `last` shows); after
    `timeout_s` this raises NeverHappened, which names `what` and the last value seen."""
    deadline, last = time.monotonic() + timeout_s, NOT_YET
    while True:
        try:
            last = probe()
            if until(last):
                return last
        except ignoring as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise NeverHappened(what, f"waited {timeout_s:g} s", last)
        time.sleep(every_s)


async def eventually_async(probe: Callable[[], Any], what: str, *, until: Callable[[Any], bool] = bool,
                           timeout_s: float = 15.0, every_s: float = 0.02, ignoring: tuple = ()) -> Any:
    """`eventually` for an event loop: `probe` may return a value or an awaitable, and the loop runs
    between tries."""
    deadline, last = time.monotonic() + timeout_s, NOT_YET
    while True:
        try:
            last = probe()
            if inspect.isawaitable(last):
                last = await last
            if until(last):
                return last
        except ignoring as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise NeverHappened(what, f"waited {timeout_s:g} s", last)
        await asyncio.sleep(every_s)


def read_until(stream, marker, what: str):
    """Read `stream` (text or bytes, with a blocking readline) until a line holds `marker`; return that line.

    At the end of the stream this raises NeverHappened with the last line read, instead of reading
    empty lines for ever."""
    last = NOT_YET
    while line := stream.readline():
        if marker in line:
            return line
        last = line
    raise NeverHappened(what, "the stream ended first", last)


async def read_until_async(reader: asyncio.StreamReader, marker: bytes, what: str) -> bytes:
    """`read_until` for an asyncio stream."""
    last = NOT_YET
    while line := await reader.readline():
        if marker in line:
            return line
        last = line
    raise NeverHappened(what, "the stream ended first", last)
