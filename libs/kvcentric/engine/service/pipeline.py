"""A prefill stage's engine side (Mooncake §5.1, chunked pipeline parallelism): `StageEngine` schedules the
chunks of a prompt on one stage (the first from its FIFO as a whole instance would, the later ones as the
previous stage's hidden states arrive), `StageSteps` is its step as the step runner takes it, `StagePush`
streams this stage's layers' KV to decode as one of several senders of the request, and `StageTransfer` moves
hidden states between stages over gRPC.

Each stage keeps the KV of its own layers (a later chunk attends to the earlier chunks' KV of the same
layers), so stages exchange only hidden states. It computes and moves bytes; it does not place requests.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Awaitable, Callable

import grpc
import logging
import msgspec
import torch

from kvcentric.core.hashing import BlockHasher
from kvcentric.core.protocol import PrefillJob, decode, encode
from kvcentric.core.protocol import TokenChunk
from kvcentric.engine.cores.prefill import PrefillChunk, PrefillEngine, PrefillRejected, PrefillWork
from kvcentric.engine.cores.role_steps import PrefillPass, prompt_chunks
from kvcentric.engine.cores.step import Computed
from kvcentric.engine.model.runner import kv_payload
from kvcentric.engine.model.stage import StageRunner, hidden_bytes, hidden_tensor
from kvcentric.engine.service.streaming import RequestPush
from kvcentric.core.block_pool import BlockPool
from kvcentric.proto import kv_pb2
from kvcentric.runtime.kvwire import LayerData
from kvcentric.runtime.security import TransferTls
from kvcentric.runtime.security import channel as open_channel
from kvcentric.runtime.transfer import CHANNEL_OPTIONS, checksum

SERVICE = "kvcentric.kv.StageTransfer"
PUSH_HIDDEN = f"/{SERVICE}/PushHidden"
NO_TOKEN = -1
"""What a stage that samples nothing closes its KV push with (the commit is the last stage's)."""
log = logging.getLogger("kvcentric.prefill")


@dataclasses.dataclass(frozen=True)
class StageChunk(PrefillChunk):
    hidden: torch.Tensor | None = None
    """The previous stage's output for these tokens (None on the first stage)."""


@dataclasses.dataclass(frozen=True)
class Hidden:
    start: int
    end: int
    tensor: torch.Tensor


class StageEngine(PrefillEngine):
    """`PrefillEngine` on one stage's layers. A later stage takes its jobs from the hidden states' first
    chunk, computes the chunks the first stage cut, in order, and reuses a cached prefix exactly as long as
    the first stage's (its own cache must hold it: stages see the same requests)."""

    def __init__(self, runner: StageRunner, pool: BlockPool, hasher: BlockHasher, chunk_tokens: int = 512) -> None:
        super().__init__(runner, pool, hasher, chunk_tokens)
        self.stage: StageRunner = runner
        self.inbox: dict[str, collections.deque[Hidden]] = {}
        self.first_cached: dict[str, int] = {}
        """A later stage: the prefix each queued request's first stage did not compute."""
        self.failures: list[tuple[PrefillJob, str]] = []
        """Jobs this stage could not start (its cache lacks the prefix the first stage skipped)."""
        self.heard_at: dict[str, float] = {}
        """A later stage: when each request's latest hidden states arrived."""

    def check(self, job: PrefillJob) -> None:
        super().check(job)
        if job.sampling.prompt_logprobs is not None:
            raise PrefillRejected("prompt logprobs are not computed by a pipelined prefill group")
        if self.stage.position.first and len(job.pipeline_addrs) != self.stage.position.stages - 1:
            raise PrefillRejected(f"a job for group {self.stage.position.group} must name its "
                                  f"{self.stage.position.stages - 1} later stages, got {len(job.pipeline_addrs)}")

    def receive(self, request_id: str, hidden: Hidden, now: float) -> None:
        """Hidden states of the request's next chunk from the previous stage."""
        self.inbox.setdefault(request_id, collections.deque()).append(hidden)
        self.heard_at[request_id] = now

    def stalled(self, now: float, limit_s: float) -> list[PrefillWork]:
        """Requests computing here whose previous stage has sent nothing for `limit_s` (it died)."""
        return [work for work in self.running.values()
                if not work.cancelled and now - self.heard_at.get(work.request_id, now) > limit_s]

    def schedule(self) -> PrefillChunk | None:
        if self.stage.position.first:
            return super().schedule()
        work = next(iter(self.running.values()), None) or self._start_next()
        arrived = self.inbox.get(work.request_id) if work is not None else None
        if work is not None and work.cancelled:  # an empty chunk: the work loop ends it
            return StageChunk(work, work.done, work.done)
        if work is None or not arrived:
            return None
        hidden = arrived.popleft()
        if hidden.start != work.done:
            raise ValueError(f"{work.request_id}: hidden states of tokens {hidden.start}.. while {work.done} are done")
        return StageChunk(work, hidden.start, hidden.end, hidden=hidden.tensor)

    def _start_next(self) -> PrefillWork | None:
        if self.stage.position.first:
            return super()._start_next()
        if not self.queue:
            return None
        job = self.queue[0]
        hashes = self.hashes(job.token_ids)
        skipped = self.first_cached.get(job.request_id, 0)
        cached = self.kv.computed_blocks(hashes, skipped // self.kv.block_size)
        if len(cached) * self.kv.block_size < skipped:
            self.queue.popleft()
            self.failures.append((job, f"stage {self.stage.position.index} lacks the cached prefix of "
                                       f"{skipped} tokens the first stage reused"))
            return None
        needed = self.kv.blocks_for(len(job.token_ids)) - len(cached)
        if not self._fits(cached, needed):
            return None
        self.queue.popleft()
        self.first_cached.pop(job.request_id, None)
        work = PrefillWork(job, self.kv.allocate(needed, cached), skipped, hashes, done=skipped)
        self.running[job.request_id] = work
        return work

    def compute(self, chunk: PrefillChunk, on_layer=None) -> int | bytes | None:
        """Compute one chunk: the hidden states as bytes (not the last stage), else on the last chunk the
        first generated token."""
        work = chunk.work
        hidden = chunk.hidden if isinstance(chunk, StageChunk) else None
        out = self.stage.prefill(work.job.token_ids, work.blocks, chunk.start, chunk.end, on_layer, hidden=hidden)
        if not self.stage.position.last:
            return hidden_bytes(out)
        if not chunk.last:
            return None
        return self.sample_first(work, out)

    def forget(self, request_id: str) -> None:
        """Drop what arrived for a request that ended."""
        self.inbox.pop(request_id, None)
        self.first_cached.pop(request_id, None)
        self.heard_at.pop(request_id, None)


class StagePush(RequestPush):
    """This stage's layers of one request to decode: one of `stages` senders (the KV header's stripes; the
    last stage is stripe 0, whose commit carries the first token); layers named by their index in the
    whole model."""

    runner: StageRunner

    def _header(self) -> kv_pb2.KVHeader:
        header = super()._header()
        position = self.runner.position
        header.num_layers = self.runner.whole.num_layers
        header.stripes, header.stripe = position.stages, position.stages - 1 - position.index
        return header

    def _read(self, layer: int, start: int, end: int) -> LayerData:
        key, value, crc = self.runner.read_layer(layer, self.work.blocks, start, end)
        return LayerData(self.runner.layers[layer], start, end, key, value, crc)

    def hook(self, start: int):
        """As `RequestPush.hook`, for layers named globally: the hand-off at this stage's last layer."""
        if self.runner.device.type == "cuda":
            return self._staged_hook(start, 0)
        pending: list[LayerData] = []
        last = self.runner.layers[-1]

        def on_layer(layer: int, keys, values) -> None:
            key, value, crc = kv_payload(keys, values)
            pending.append(LayerData(layer, start, start + keys.shape[0], key, value, crc))
            if layer == last or sum(p.nbytes for p in pending) >= self.handoff_bytes:
                self.loop.call_soon_threadsafe(self._hand_over, pending.copy())
                pending.clear()
        return on_layer

    async def _live(self):
        async for item in super()._live():
            if isinstance(item, kv_pb2.KVCommit) and not self.runner.position.last:
                return
            yield item

    async def _resend(self):
        async for item in super()._resend():
            if isinstance(item, kv_pb2.KVCommit) and not self.runner.position.last:
                return
            yield item


def hidden_chunk(work: PrefillWork, start: int, end: int, data: bytes, dtype: str, first: bool) -> kv_pb2.HiddenChunk:
    """The message carrying one chunk's hidden states to the next stage; the first also carries the job,
    naming the stages after the next one."""
    job = b""
    if first:
        job = encode(msgspec.structs.replace(work.job, pipeline_addrs=work.job.pipeline_addrs[1:]))
    return kv_pb2.HiddenChunk(request_id=work.request_id, job=job, num_cached=work.num_cached, token_start=start,
                              token_end=end, positions=range(start, end), dtype=dtype, hidden=data,
                              checksum=checksum(data))


def read_hidden(chunk: kv_pb2.HiddenChunk, dtype: str, hidden_size: int) -> tuple[PrefillJob | None, Hidden]:
    """The job (first chunk) and the hidden states of a received chunk; ValueError when they are wrong."""
    if chunk.dtype != dtype:
        raise ValueError(f"hidden states in {chunk.dtype}, this stage runs {dtype}")
    if checksum(chunk.hidden) != chunk.checksum:
        raise ValueError(f"checksum mismatch in the hidden states of {chunk.request_id}")
    if list(chunk.positions) != list(range(chunk.token_start, chunk.token_end)):
        raise ValueError(f"{chunk.request_id}: positions do not match tokens {chunk.token_start}..{chunk.token_end}")
    tokens = chunk.token_end - chunk.token_start
    job = decode(chunk.job, PrefillJob) if chunk.job else None
    return job, Hidden(chunk.token_start, chunk.token_end, hidden_tensor(chunk.hidden, dtype, tokens, hidden_size))


def stage_handler(on_chunk: Callable[[kv_pb2.HiddenChunk], Awaitable[None]]) -> grpc.GenericRpcHandler:
    """The StageTransfer gRPC service: each chunk to `on_chunk`, whose exception is the refusal in the ack."""
    async def push_hidden(chunk: kv_pb2.HiddenChunk, context) -> kv_pb2.PushAck:
        try:
            await on_chunk(chunk)
        except Exception as exc:  # noqa: BLE001 - every refusal goes back to the sender as an ack
            return kv_pb2.PushAck(ok=False, error=str(exc))
        return kv_pb2.PushAck(ok=True, bytes_received=len(chunk.hidden))
    handler = grpc.unary_unary_rpc_method_handler(push_hidden, request_deserializer=kv_pb2.HiddenChunk.FromString,
                                                  response_serializer=kv_pb2.PushAck.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE, {"PushHidden": handler})


class StageClient:
    """Sends hidden states to next stages, a channel per peer."""

    def __init__(self, tls: TransferTls | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.tls = tls
        """Mutual TLS to the next stages (the deployment's CA), as the KV transfer; None: plaintext."""

    async def send(self, addr: str, chunk: kv_pb2.HiddenChunk, timeout_s: float = 30.0) -> None:
        channel = self._channels.get(addr)
        if channel is None:
            channel = self._channels[addr] = open_channel(addr, self.tls, CHANNEL_OPTIONS)
        call = channel.unary_unary(PUSH_HIDDEN, request_serializer=kv_pb2.HiddenChunk.SerializeToString,
                                   response_deserializer=kv_pb2.PushAck.FromString)
        try:
            ack = await call(chunk, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise ConnectionError(f"next stage {addr}: {exc.code().name}: {exc.details()}") from exc
        if not ack.ok:
            raise ConnectionError(f"next stage {addr} refused the hidden states: {ack.error}")

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels.values()), return_exceptions=True)
        self._channels.clear()


class StageSteps:
    """A pipeline stage's step (`StepCore`): the next chunk whose input is here (its tokens at the first stage, the
    previous stage's hidden states at a later one) over this stage's layers, with its KV push's layer hook (the
    service opens the push: `PrefillService.open_pushes`). Its result is the hidden states to hand on, or at the last
    stage the first token on a prompt's last chunk. A failed chunk's request is failed by the service, once, with
    its push ended (`StageService.fail`), so `fail` gives no chunks of its own."""

    def __init__(self, engine: StageEngine) -> None:
        self.engine = engine

    def schedule(self) -> tuple[PrefillPass | None, list[TokenChunk]]:
        try:
            chunk = self.engine.schedule()
        except ValueError as exc:  # hidden states out of order: a bug or a restarted peer
            log.error("pipeline stage out of step: %s", exc)
            chunk = None
        if chunk is None:
            return None, []
        return PrefillPass([chunk], set(), [chunk], [None]), []

    def execute(self, plan: PrefillPass) -> int | bytes | None:
        return self.engine.compute(plan.chunks[0], plan.hooks[0])

    def computed(self, plan: PrefillPass) -> Computed:
        return Computed(prompt_chunks(plan.scheduled))

    def update(self, plan: PrefillPass, out: int | bytes | None) -> list[TokenChunk]:
        self.engine.update(plan.chunks[0])
        return []

    def fail(self, plan: PrefillPass, error: Exception) -> list[TokenChunk]:
        return []

    def release(self, plan: PrefillPass) -> None:
        pass
