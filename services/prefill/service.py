"""The prefill service's asyncio shell: takes jobs from NATS, runs the prefill engine chunk by chunk in
the model thread, and pushes each layer's KV to the decode instance's messenger over gRPC as soon as
that layer of the chunk is computed, so the transfer overlaps the remaining layers and chunks.
"""

from __future__ import annotations

import asyncio

from kvcentric.engine.prefill import PrefillChunk, PrefillEngine, PrefillRejected, PrefillWork
from kvcentric.engine.runner import kv_payload
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.shell import EngineService
from kvcentric.hashing import BlockHasher
from kvcentric.proto import kv_pb2
from kvcentric.protocol import Cancel, LoadReport, PrefillJob, SubmitAck, TokenChunk, Subjects
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
        self.engine = PrefillEngine(self.runner, self.pool, hasher, config.prefill_chunk)
        self.pusher = KVPusher()
        self.pushes: dict[str, tuple[asyncio.Queue, asyncio.Future]] = {}

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
            chunk = self.engine.schedule()
            if chunk is None:
                await self.wait_for_work(0.05)
                continue
            await self.prefill_chunk(chunk)
            await self.publish_kv_events()

    async def prefill_chunk(self, chunk: PrefillChunk) -> None:
        """Compute one chunk while its layers stream to decode; the first chunk opens the push, the
        last closes it with the first token. Any failure fails the request, not the service."""
        work = chunk.work
        try:
            if chunk.first:
                self.open_push(work)
            if work.cancelled:
                raise asyncio.CancelledError
            push = self.pushes[work.request_id][1]
            if push.done():  # the receiver gave up already: surface its error now, not after the prompt
                await push
                raise RuntimeError("the KV push ended before the prompt was computed")
            token = await self.run_model(self.engine.execute, chunk, self.layer_hook(work))
            self.engine.update(chunk)
            if chunk.last:
                await self.close_push(work, token)
        except asyncio.CancelledError:
            if not work.cancelled:
                raise
            self.end_push(work)
        except Exception as exc:  # noqa: BLE001 - the request fails, the service lives on
            self.end_push(work)
            await self.fail(work, exc)

    def open_push(self, work: PrefillWork) -> None:
        """Start streaming to the decode instance: the header, then the cached prefix's KV per layer."""
        layers: asyncio.Queue = asyncio.Queue()
        push = asyncio.ensure_future(self.pusher.push(work.job.decode_kv_addr, self.chunks(work, layers)))
        push.add_done_callback(lambda task: task.cancelled() or task.exception())
        self.pushes[work.request_id] = (layers, push)
        for layer in range(self.runner.config.num_layers) if work.num_cached else ():
            key, value, crc = self.runner.read_layer(layer, work.blocks, 0, work.num_cached)
            layers.put_nowait(kv_pb2.LayerChunk(layer=layer, token_start=0, token_end=work.num_cached, key=key,
                                                value=value, checksum=crc))

    async def close_push(self, work: PrefillWork, first_token: int) -> None:
        layers, push = self.pushes[work.request_id]
        layers.put_nowait(first_token)
        try:
            await push
        finally:
            self.end_push(work)

    def end_push(self, work: PrefillWork) -> None:
        """Stop the push (if still running) and release the prompt's blocks."""
        layers, push = self.pushes.pop(work.request_id, (None, None))
        if push is not None:
            push.cancel()
        if work.request_id in self.engine.running:
            self.engine.finish(work)

    def layer_hook(self, work: PrefillWork):
        """Runs in the model thread after each layer: that layer's new KV to wire bytes, handed to the loop."""
        loop = asyncio.get_running_loop()
        layers, _ = self.pushes[work.request_id]
        start = work.done

        def on_layer(layer: int, keys, values) -> None:
            key, value, crc = kv_payload(keys, values)
            chunk = kv_pb2.LayerChunk(layer=layer, token_start=start, token_end=start + keys.shape[0], key=key,
                                      value=value, checksum=crc)
            loop.call_soon_threadsafe(layers.put_nowait, chunk)
        return on_layer

    async def chunks(self, work: PrefillWork, layers: asyncio.Queue):
        """The push stream: header, layer chunks as they come, and the commit once the first token is in."""
        config = self.runner.config
        yield kv_pb2.KVChunk(header=kv_pb2.KVHeader(
            request_id=work.request_id, num_layers=config.num_layers, num_tokens=work.num_tokens,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=self.runner.dtype_name,
            token_ids=work.job.token_ids))
        total = 0
        while not isinstance(item := await layers.get(), int):
            total += len(item.key) + len(item.value)
            yield kv_pb2.KVChunk(layer=item)
        yield kv_pb2.KVChunk(commit=kv_pb2.KVCommit(first_token=item, total_bytes=total))

    async def fail(self, work: PrefillWork, exc: BaseException) -> None:
        self.counters["requests_failed_total"] += 1
        self.log.warning("prefill of %s failed: %s", work.request_id, exc)
        self.emit([TokenChunk(work.request_id, 0, [], "error", len(work.job.token_ids), 0, f"prefill failed: {exc}")])
