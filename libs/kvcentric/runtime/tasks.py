"""The background tasks of one service and the event that stops them: spawn, run periodically, cancel
all at shutdown. It knows nothing of NATS or HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable


class Tasks:
    """Owns a service's background tasks; `stopping` is its one shutdown signal."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.stopping = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Awaitable, name: str) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("task %s failed", task.get_name(), exc_info=task.exception())

    async def every(self, period_s: float, action: Callable[[], Awaitable[None]]) -> None:
        """Run `action` every period until stopping; an exception is logged, not fatal."""
        while not self.stopping.is_set():
            try:
                await action()
            except Exception:  # noqa: BLE001 - a periodic job must survive one failure
                self.log.exception("periodic %s failed", getattr(action, "__name__", action))
            try:
                await asyncio.wait_for(self.stopping.wait(), period_s)
            except TimeoutError:
                pass

    async def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
