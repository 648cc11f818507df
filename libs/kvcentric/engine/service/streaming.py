"""The KV push of one prefilled request to its decode instance: the layers of each chunk go out while the
model thread computes the later ones (Mooncake §5.2, layer-wise transfer; small layers are handed over
together, see HANDOFF_BYTES), the commit carries the first token, and a receiver that asks for a resend
(a checksum failure) gets the whole KV again, read from the cache. The KV of the job's first
`kv_skip_tokens` tokens is never sent: the receiver has it from its own cluster (PrfaaS §3.3, only the
uncached part crosses datacenters). On CUDA a layer leaves the device on a
side stream into pinned staging buffers (`engine/model/staging.py`) while the next layer computes; on CPU the
hook copies it out itself.

It moves bytes for one request; it does not schedule prefill or decide where the KV goes.
"""

from __future__ import annotations

import asyncio
import time

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvcentric.runtime import tracing
from kvcentric.engine.cores.prefill import PrefillWork
from kvcentric.engine.model.runner import ModelRunner, kv_payload
from kvcentric.runtime.kvwire import LayerData
from kvcentric.proto import kv_pb2
from kvcentric.runtime.transfer import KVPusher


HANDOFF_BYTES = 1 << 20
"""The model thread hands computed layers to the event loop once this many bytes of them are pending, and
at a chunk's last layer. Each hand-off wakes the loop, which then holds the GIL for gRPC sends while the
model thread needs it between ops: a short prefill handing over its small layers one by one waits for the GIL
more often than sending them together after the last layer costs (docs/performance-notebook.md, "Figures").
Layers of 1 MiB or more (a chunk of 512 tokens of `small`) still go over one by one."""


PUSH_STREAM_TIMEOUT_S = 3600.0
"""The gRPC deadline of a request's push stream, which stays open while the prompt computes (a long prompt on
slow hardware takes minutes): what bounds a push that stalls is the drain deadline once the prompt is computed
(`PrefillService.drain_push`) and the decode instance's wait for the KV (`--kv-wait-s`, the job's)."""


class RequestPush:
    def __init__(self, runner: ModelRunner, pusher: KVPusher, work: PrefillWork, retries: int = 2,
                 trace_context=None, handoff_bytes: int = HANDOFF_BYTES, pool_addr: str = "") -> None:
        """`pool_addr`: the sender's messenger, named in the header so that the receiver may put the blocks of
        the tokens it generates into its pool ("": the sender has none)."""
        self.runner, self.work, self.handoff_bytes, self.pool_addr = runner, work, handoff_bytes, pool_addr
        self.skip = work.job.kv_skip_tokens
        self.loop = asyncio.get_running_loop()
        self.layers: asyncio.Queue = asyncio.Queue()
        self.first_token: asyncio.Future = self.loop.create_future()
        self.extras = b""
        self.span = tracing.start_span("messenger.transfer", trace_context, tracing.SpanKind.CLIENT,
                                       {"kvc.request_id": work.request_id, "kvc.peer": work.job.decode_kv_addr})
        self.started = time.monotonic()
        metadata = tracing.inject_metadata(parent=trace.set_span_in_context(self.span, trace_context))
        self.task = asyncio.ensure_future(pusher.push_with_retry(work.job.decode_kv_addr, self._chunks, retries,
                                                                 PUSH_STREAM_TIMEOUT_S, metadata=metadata))
        self.task.add_done_callback(self._done)
        self.prefix_loading = work.num_cached > self.skip and work.loading is not None
        """The cached prefix is still arriving from the host pool layer by layer (Mooncake §5.2): each layer of
        it goes out from the first chunk's hook, once that layer is in the cache, instead of all now."""
        if work.num_cached > self.skip and not self.prefix_loading:
            self._send_cached_prefix()

    def _done(self, task: asyncio.Task) -> None:
        error = "cancelled" if task.cancelled() else str(task.exception() or "")
        if not error:
            self.span.set_attributes({"kvc.bytes": task.result(),
                                      "kvc.duration_s": round(time.monotonic() - self.started, 6)})
        else:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()

    def _send_cached_prefix(self) -> None:
        """The prefix found in the local cache is not computed: send its KV (after the skipped tokens)
        from the cache now."""
        for layer in range(self.runner.config.num_layers):
            self.layers.put_nowait(self._read(layer, self.skip, self.work.num_cached))

    def _read(self, layer: int, start: int, end: int) -> LayerData:
        key, value, crc = self.runner.read_layer(layer, self.work.blocks, start, end)
        return LayerData(layer, start, end, key, value, crc)

    def hook(self, start: int):
        """The layer hook for a chunk starting at `start`; runs in the model thread. Layers go to the event
        loop once `handoff_bytes` of them are pending, and the rest after the chunk's last layer. The first
        chunk's hook also sends each layer of a cached prefix that was still loading."""
        on_layer = self._chunk_hook(start)
        if not self.prefix_loading:
            return on_layer
        self.prefix_loading = False
        on_prefix = self._chunk_hook(self.skip)

        def prefix_then_chunk(layer: int, keys, values) -> None:
            on_prefix(layer, *self.runner.layer_kv(layer, self.work.blocks, self.skip, self.work.num_cached))
            on_layer(layer, keys, values)
        return prefix_then_chunk

    def _chunk_hook(self, start: int):
        drop = max(0, self.skip - start)  # leading tokens of this chunk the receiver has already
        if self.runner.device.type == "cuda":
            return self._staged_hook(start, drop)
        pending: list[LayerData] = []
        pending_bytes = 0
        last = self.runner.config.num_layers - 1

        def on_layer(layer: int, keys, values) -> None:
            nonlocal pending_bytes
            if drop >= keys.shape[0]:  # the whole chunk is before the skipped prefix's end
                return
            key, value, crc = kv_payload(keys[drop:], values[drop:])
            data = LayerData(layer, start + drop, start + keys.shape[0], key, value, crc)
            pending.append(data)
            pending_bytes += data.nbytes
            if layer == last or pending_bytes >= self.handoff_bytes:
                self.loop.call_soon_threadsafe(self._hand_over, pending.copy())
                pending.clear()
                pending_bytes = 0
        return on_layer

    def _staged_hook(self, start: int, drop: int):
        """CUDA: each layer is queued for a copy into pinned memory behind its compute and handed to the
        event loop once its bytes are on the host, while the model thread goes on with the next layer."""
        def on_layer(layer: int, keys, values) -> None:
            end = start + keys.shape[0]
            if drop >= keys.shape[0]:
                return

            def deliver(key: bytes, value: bytes, crc: int) -> None:
                self.loop.call_soon_threadsafe(self._hand_over, [LayerData(layer, start + drop, end, key, value,
                                                                           crc)])
            self.runner.staging.stage(keys[drop:], values[drop:], deliver, self._failed_threadsafe)
        return on_layer

    def _failed_threadsafe(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(self.layers.put_nowait, exc)

    def _hand_over(self, chunks: list[LayerData]) -> None:
        for chunk in chunks:
            self.layers.put_nowait(chunk)

    def finish(self, first_token: int, extras: bytes = b"") -> None:
        """Every chunk is computed: close the stream with the first token (and its logprobs in `extras`); on
        CUDA once the staged layers are handed over, so the commit never overtakes a layer."""
        self.extras = extras
        if self.runner.device.type == "cuda":
            self.runner.staging.after(lambda: self.loop.call_soon_threadsafe(self._close, first_token))
        else:
            self._close(first_token)

    def _close(self, first_token: int) -> None:
        self.layers.put_nowait(first_token)
        if not self.first_token.done():
            self.first_token.set_result(first_token)

    def cancel(self) -> None:
        self.task.cancel()
        if not self.first_token.done():
            self.first_token.cancel()

    @property
    def failed_early(self) -> bool:
        """The push ended (with an error) before the prompt was computed."""
        return self.task.done() and not self.first_token.done()

    def _header(self) -> kv_pb2.KVHeader:
        config, work = self.runner.config, self.work
        return kv_pb2.KVHeader(request_id=work.request_id, num_layers=config.num_layers, num_tokens=work.num_tokens,
                               num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                               dtype=self.runner.dtype_name, token_ids=work.job.token_ids, pool_addr=self.pool_addr)

    def _chunks(self, attempt: int):
        return self._live() if attempt == 0 else self._resend()

    async def _live(self):
        yield self._header()
        total = 0
        while not isinstance(item := await self.layers.get(), int):
            if isinstance(item, BaseException):
                raise item
            total += item.nbytes
            yield item
        yield kv_pb2.KVCommit(first_token=item, total_bytes=total, extras=self.extras)

    async def _resend(self):
        token = await asyncio.shield(self.first_token)
        yield self._header()
        total = 0
        for layer in range(self.runner.config.num_layers):
            chunk = self._read(layer, self.skip, self.work.num_tokens)
            total += chunk.nbytes
            yield chunk
        yield kv_pb2.KVCommit(first_token=token, total_bytes=total, extras=self.extras)
