"""The prefill service's asyncio shell: takes jobs from NATS, runs the prefill engine one prompt at a
time in the model thread, and pushes each layer's KV to the decode instance's messenger over gRPC as
soon as that layer is computed, so the transfer overlaps the remaining layers.
"""

from __future__ import annotations

import asyncio

from kvcentric.engine.prefill import PrefillEngine, PrefillRejected, PrefillWork
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.shell import EngineService
from kvcentric.hashing import BlockHasher
from kvcentric.proto import kv_pb2
from kvcentric.protocol import (BlockEvicted, BlockStored, Cancel, KVEventBatch, LoadReport, PrefillJob,
                                SubmitAck, Subjects, TokenChunk)
from kvcentric.transfer import KVPusher


class RefusingSink:
    """A prefill node's messenger takes no pushes (it sends them)."""

    def begin(self, header):
        raise ValueError("this is a prefill instance; push KV to a decode instance")

    def write(self, request_id, chunk): ...
    def commit(self, request_id, commit): ...
    def abort(self, request_id, reason): ...


class PrefillService(EngineService):
    role = "prefill"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        hasher = BlockHasher(config.hash_algo, config.block_size)
        self.engine = PrefillEngine(self.runner, self.pool, hasher)
        self.pusher = KVPusher()

    def kv_sink(self):
        return RefusingSink()

    async def start(self) -> None:
        await super().start()
        await self.subscribe(Subjects.submit(self.role, self.instance_id), PrefillJob, self.on_submit,
                             bad_reply=lambda error: SubmitAck(False, error))

    async def stop(self) -> None:
        await super().stop()
        await self.pusher.close()

    async def on_submit(self, job: PrefillJob) -> SubmitAck:
        try:
            self.engine.submit(job)
        except PrefillRejected as exc:
            return SubmitAck(False, str(exc))
        self.wake.set()
        return SubmitAck(True)

    async def on_cancel(self, cancel: Cancel) -> None:
        if self.engine.cancel(cancel.request_id):
            self.log.info("cancelled %s", cancel.request_id)

    def load_report(self) -> LoadReport:
        return self.base_load(len(self.engine.queue), self.engine.queued_tokens, len(self.engine.running))

    async def work_loop(self) -> None:
        while not self.stopping.is_set():
            work = self.engine.schedule()
            if work is None:
                await self.wait_for_work(0.05)
                continue
            await self.prefill(work)
            await self.publish_kv_events()

    async def prefill(self, work: PrefillWork) -> None:
        """Compute one prompt while its layers stream to decode; on any failure tell the client."""
        layers: asyncio.Queue = asyncio.Queue()
        first_token: asyncio.Future = asyncio.get_running_loop().create_future()
        push = asyncio.ensure_future(
            self.pusher.push(work.job.decode_kv_addr, self.chunks(work, layers, first_token)))
        push.add_done_callback(lambda task: task.cancelled() or task.exception())
        computed = False
        try:
            token = await self.run_model(self.engine.execute, work, self.layer_hook(work, layers))
            computed = True
            if work.cancelled:
                raise asyncio.CancelledError  # handled below: the client is gone
            first_token.set_result(token)
            await push
        except asyncio.CancelledError:
            if not work.cancelled:
                raise
        except Exception as exc:  # noqa: BLE001 - the request fails, the service lives on
            await self.fail(work, exc)
        finally:
            push.cancel()
            if not first_token.done():
                first_token.cancel()
            self.engine.finish(work, computed)

    def layer_hook(self, work: PrefillWork, layers: asyncio.Queue):
        """Runs in the model thread after each layer: copy that layer's KV out and hand it to the loop."""
        loop = asyncio.get_running_loop()
        num_tokens = len(work.job.token_ids)

        def on_layer(layer: int) -> None:
            key, value, crc = self.runner.read_layer(layer, work.blocks, num_tokens)
            chunk = kv_pb2.LayerChunk(layer=layer, token_start=0, token_end=num_tokens, key=key, value=value,
                                      checksum=crc)
            loop.call_soon_threadsafe(layers.put_nowait, chunk)
        return on_layer

    async def chunks(self, work: PrefillWork, layers: asyncio.Queue, first_token: asyncio.Future):
        config = self.runner.config
        yield kv_pb2.KVChunk(header=kv_pb2.KVHeader(
            request_id=work.request_id, num_layers=config.num_layers, num_tokens=len(work.job.token_ids),
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=self.runner.dtype_name,
            token_ids=work.job.token_ids))
        total = 0
        for _ in range(config.num_layers):
            chunk = await layers.get()
            total += len(chunk.key) + len(chunk.value)
            yield kv_pb2.KVChunk(layer=chunk)
        token = await first_token
        yield kv_pb2.KVChunk(commit=kv_pb2.KVCommit(first_token=token, total_bytes=total))

    async def fail(self, work: PrefillWork, exc: BaseException) -> None:
        self.counters["requests_failed_total"] += 1
        self.log.warning("prefill of %s failed: %s", work.request_id, exc)
        await self.publish(Subjects.out(work.request_id),
                           TokenChunk(work.request_id, 0, [], "error", len(work.job.token_ids), 0,
                                      f"prefill failed: {exc}"))

    async def publish_kv_events(self) -> None:
        stored, evicted = self.pool.drain_events()
        events = ([BlockEvicted(self.instance_id, evicted)] if evicted else []) + \
                 ([BlockStored(self.instance_id, stored)] if stored else [])
        if events:
            await self.publish(Subjects.kv_events(self.instance_id), KVEventBatch(events))
