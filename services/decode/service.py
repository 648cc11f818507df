"""The decode service's asyncio shell: registers jobs from NATS, receives their KV through the
in-process messenger's gRPC server, runs decode steps in the model thread, and streams tokens on
`kvc.req.<id>.out`. It never computes a prompt: a request starts only once all its layers arrived.
"""

from __future__ import annotations

import asyncio
import time

from kvcentric.engine.decode import DecodeEngine, KVRejected
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.shell import EngineService
from kvcentric.protocol import Cancel, DecodeJob, LoadReport, SubmitAck, Subjects, TokenChunk


class DecodeSink:
    """Writes pushed KV straight into the decode engine's paged cache."""

    def __init__(self, service: "DecodeService") -> None:
        self.service = service
        self.engine = service.engine

    def begin(self, header) -> None:
        if header.dtype != self.service.runner.dtype_name:
            raise KVRejected(f"KV dtype {header.dtype}, this instance runs {self.service.runner.dtype_name}")
        self.engine.begin_kv(header.request_id, header.num_tokens, header.num_layers, header.token_ids)

    def write(self, request_id: str, chunk) -> None:
        self.engine.write_kv(request_id, chunk.layer, chunk.token_start, chunk.token_end, chunk.key, chunk.value)

    def commit(self, request_id: str, commit) -> None:
        self.service.emit(self.engine.commit_kv(request_id, commit.first_token))
        self.service.wake.set()

    def abort(self, request_id: str, reason: str) -> None:
        self.service.emit([self.engine.abort(request_id, "error", f"KV transfer failed: {reason}")])


class DecodeService(EngineService):
    role = "decode"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.engine = DecodeEngine(self.runner, self.pool, config.max_batch)
        self.outbox: asyncio.Queue[TokenChunk] = asyncio.Queue()

    def kv_sink(self):
        return DecodeSink(self)

    async def start(self) -> None:
        await super().start()
        await self.subscribe(Subjects.submit(self.role, self.instance_id), DecodeJob, self.on_submit,
                             bad_reply=lambda error: SubmitAck(False, error))
        self.spawn(self.send_outbox(), "outbox")

    async def on_submit(self, job: DecodeJob) -> SubmitAck:
        try:
            self.engine.add(job, time.monotonic())
        except KVRejected as exc:
            return SubmitAck(False, str(exc))
        return SubmitAck(True)

    async def on_cancel(self, cancel: Cancel) -> None:
        self.emit([self.engine.abort(cancel.request_id, "abort")])

    def load_report(self) -> LoadReport:
        waiting = sum(r.state != "running" for r in self.engine.requests.values())
        return self.base_load(waiting, 0, len(self.engine.requests) - waiting)

    def emit(self, chunks: list[TokenChunk | None]) -> None:
        """Queue token chunks for publishing; one sender keeps them in order."""
        for chunk in chunks:
            if chunk is not None:
                self.outbox.put_nowait(chunk)

    async def send_outbox(self) -> None:
        while True:
            chunk = await self.outbox.get()
            await self.publish(Subjects.out(chunk.request_id), chunk)

    async def work_loop(self) -> None:
        while not self.stopping.is_set():
            self.emit(self.engine.expire(time.monotonic()))
            if not self.engine.has_work:
                await self.wait_for_work(0.1)
                continue
            batch, failed = self.engine.schedule()
            self.emit(failed)
            if not batch:  # everything left is preempted and waiting for blocks
                await self.wait_for_work(0.05)
                continue
            tokens = await self.run_model(self.engine.execute, batch)
            self.emit(self.engine.update(batch, tokens))
