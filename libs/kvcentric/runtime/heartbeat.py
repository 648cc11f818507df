"""An instance's heartbeat: a thread of its own, with its own event loop and NATS connection, that
publishes the messages it is given whenever asked and at least every period. Nothing the service's
event loop waits on (model steps, KV copies, gRPC streams, a slow handler) can hold it back; only the
process stopping (or a C extension keeping the GIL) can. It sends what `messages` returns; it does
not decide what a message says.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from kvcentric.core.protocol import encode
from kvcentric.runtime.bus import connect_nats
from kvcentric.runtime.security import NatsAccess

Messages = Callable[[float], Sequence[tuple[str, msgspec.Struct]]]
"""Called in the heartbeat thread with time.monotonic(): the (subject, message) pairs to publish now."""


class Heartbeat:
    """Publishes `messages(now)` on every `beat` and every `period_s`, from a thread of its own."""

    def __init__(self, nats_url: NatsAccess | str, name: str, period_s: float, messages: Messages,
                 log: logging.Logger) -> None:
        self.nats_url, self.name, self.period_s, self.messages, self.log = nats_url, name, period_s, messages, log
        self.beats = 0
        """Ticks that published at least one message."""
        self.longest_gap_s = 0.0
        """The longest time between two ticks: how late the thread ever was."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._waiters: list[concurrent.futures.Future] = []
        self._thread = threading.Thread(target=self._main, name=f"{name}-heartbeat", daemon=True)
        self._started: concurrent.futures.Future = concurrent.futures.Future()

    async def start(self) -> None:
        """Start the thread and wait until it is connected to NATS (raises what connecting raised)."""
        self._thread.start()
        await asyncio.wrap_future(self._started)

    def beat(self) -> concurrent.futures.Future:
        """Publish now (from any thread); the future is done once this tick's messages are out."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        if self._loop is None or self._loop.is_closed():
            done.set_result(None)
            return done
        self._loop.call_soon_threadsafe(self._ask, done)
        return done

    async def stop(self) -> None:
        """Stop the thread, draining its NATS connection first."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._halt)
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 5.0)

    # ---------------------------------------------------------------- in the heartbeat thread

    def _main(self) -> None:
        try:
            asyncio.run(self._run())
        except BaseException as exc:  # noqa: BLE001 - the starter learns why; the thread ends
            if not self._started.done():
                self._started.set_exception(exc)
            else:
                self.log.exception("heartbeat thread failed")

    def _halt(self) -> None:
        if self._stop is not None and self._wake is not None:
            self._stop.set()
            self._wake.set()

    def _ask(self, done: concurrent.futures.Future) -> None:
        self._waiters.append(done)
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake, self._stop = asyncio.Event(), asyncio.Event()
        client = await connect_nats(self.nats_url, self.name, self._stop)
        self._started.set_result(None)
        last = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self.longest_gap_s, last = max(self.longest_gap_s, now - last), now
                await self._tick(client, now)
                try:
                    await asyncio.wait_for(self._wake.wait(), self.period_s)
                except TimeoutError:
                    pass
                self._wake.clear()
        finally:
            await _close(client)

    async def _tick(self, client, now: float) -> None:
        waiters, self._waiters = self._waiters, []
        try:
            sent = self.messages(now)
            for subject, message in sent:
                await client.publish(subject, encode(message))
            self.beats += bool(sent)
        except Exception:  # noqa: BLE001 - the next tick tries again
            self.log.exception("heartbeat failed")
        for done in waiters:
            if not done.done():
                done.set_result(None)


async def _close(client) -> None:
    try:
        await asyncio.wait_for(client.drain(), 2.0)
    except (Exception, asyncio.CancelledError):  # noqa: BLE001 - closing anyway
        await client.close()
