"""The ordered way out of an engine's tokens: chunks queued by the work loop and the KV sink go out on
`kvc.req.<id>.out` from one sender, so each request's chunks keep their order.

It sends what it is given; it does not make tokens or decide when a request ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvcentric.core.protocol import Subjects, TokenChunk
from kvcentric.engine.service.spans import RequestSpans
from kvcentric.runtime.bus import Bus


class TokenOutbox:
    """Queue of token chunks to publish; a request's first tokens and final chunk also move and close its trace
    spans."""

    def __init__(self, spans: RequestSpans) -> None:
        self.spans = spans
        self.queue: asyncio.Queue[TokenChunk] = asyncio.Queue()

    def emit(self, chunks: Sequence[TokenChunk | None]) -> None:
        """Queue the chunks (None: nothing to send for that request)."""
        for chunk in chunks:
            if chunk is not None:
                self.queue.put_nowait(chunk)
                if chunk.token_ids:
                    self.spans.first_token(chunk.request_id)
                if chunk.finish_reason is not None:
                    self.spans.finish(chunk.request_id, chunk.error if chunk.finish_reason == "error" else "")

    def empty(self) -> bool:
        return self.queue.empty()

    async def send(self, bus: Bus) -> None:
        """Publish the queued chunks in order, for as long as the service runs."""
        while True:
            chunk = await self.queue.get()
            await bus.publish(Subjects.out(chunk.request_id), chunk)
