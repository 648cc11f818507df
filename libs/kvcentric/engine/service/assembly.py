"""A decode instance's KV from several senders at once (Mooncake §5.1: every stage of a prefill group streams
its own layers): `AssemblingSink` wraps the decode sink and holds a request's commit until every layer of it
is in, whichever sender's stream ends first, and a request's wait for its KV (`--kv-wait-s`) counted from the
latest layer that arrived rather than from its job.

A request pushed by one sender passes straight through. It counts layers; it does not write KV or decide
anything about the request.
"""

from __future__ import annotations

import time

from kvcentric.engine.cores.decode import DecodeEngine


def kv_complete(engine: DecodeEngine, request_id: str) -> bool:
    """Every layer of the request's prompt KV has arrived."""
    request = engine.requests.get(request_id)
    return request is not None and request.state == "receiving" and \
        all(tokens == request.job.n_prompt_tokens for tokens in request.layer_tokens)


class AssemblingSink:
    """`inner` (the decode sink) with commits of multi-sender requests held until their last layer is in."""

    def __init__(self, inner, engine: DecodeEngine) -> None:
        self.inner, self.engine = inner, engine
        self.copies_bytes = getattr(inner, "copies_bytes", False)
        self.senders: dict[str, int] = {}
        """Requests pushed by several senders, and how many."""
        self.held: dict[str, object] = {}
        """Commits that came before the other senders' layers."""

    async def begin(self, header) -> None:
        await self.inner.begin(header)
        if header.stripes > 1:
            self.senders[header.request_id] = header.stripes

    def write(self, request_id: str, chunk) -> None:
        self.inner.write(request_id, chunk)
        request = self.engine.requests.get(request_id)
        if request is not None:  # KV still flowing: its sender lives, however long a long prompt computes
            request.deadline = max(request.deadline, time.monotonic() + request.job.kv_wait_s)
        if request_id in self.held and kv_complete(self.engine, request_id):
            self._commit(request_id, self.held.pop(request_id))

    def commit(self, request_id: str, commit) -> None:
        for gone in [r for r in (*self.held, *self.senders) if r not in self.engine.requests]:  # expired meanwhile
            self.held.pop(gone, None)
            self.senders.pop(gone, None)
        if request_id in self.senders and not kv_complete(self.engine, request_id):
            self.held[request_id] = commit
            return
        self._commit(request_id, commit)

    def _commit(self, request_id: str, commit) -> None:
        self.senders.pop(request_id, None)
        self.inner.commit(request_id, commit)

    def abort(self, request_id: str, reason: str, retryable: bool = False) -> None:
        self.held.pop(request_id, None)
        self.senders.pop(request_id, None)
        self.inner.abort(request_id, reason, retryable)
