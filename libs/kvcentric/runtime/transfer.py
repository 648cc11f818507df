"""KV bytes between nodes over gRPC (grpcio, C core): the servicer that receives pushes into a sink,
serves block pulls from a source and takes block puts into a pool, and the client that pushes a request's
layers as they are produced, optionally striped over several connections and held to a per-peer rate (to
emulate a slow link), and puts blocks into a peer's pool. A peer on this host gets the layers' bytes
through a shared-memory segment (`runtime/shm.py`), the stream carrying only where they lie; a peer that
cannot open it is pushed to inline from then on. Which transport a link uses (`--kv-transport`) is chosen once
per peer from what the peer's `Stats` says of itself (`core/kvlinks.py`): its host, its GPUs, the transports it
takes; with Mooncake's Transfer Engine (`runtime/mooncake.py`) the receiver reads each announced layer from
the sender's registered memory.

The contract is `kvcentric/proto/kv.proto`; what a receiver does with the bytes (write into a decode
engine's paged cache, keep in a host pool) is the sink's business, not this module's.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Protocol

import crc32c
import grpc

from kvcentric.core.kvlinks import Endpoint, LinkChoice, choose
from kvcentric.runtime import kvwire
from kvcentric.proto import kv_pb2, kv_pb2_grpc
from kvcentric.runtime.hostid import host_id
from kvcentric.runtime.security import TransferTls
from kvcentric.runtime.security import channel as open_channel
from kvcentric.runtime.shm import (UNAVAILABLE, AttachedSegments, SegmentPool, SegmentWriter,
                                   SharedMemoryUnavailable, push_bytes)

log = logging.getLogger("kvcentric.transfer")
LINK_QUERY_S = 5.0
"""How long a pusher waits for a peer's `Stats` (what it says of itself) before it pushes over gRPC."""

MAX_MESSAGE_BYTES = 1 << 30
OFFLOAD_CHECKSUM_BYTES = 8 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


DRAIN_FLOOR_S = 10.0
"""The least time a computed request's push is given to finish: above the 5 s a receiver may wait for the
request's job before it takes the KV (`engine/service/kvsink.py`)."""
DRAIN_PRIOR_BYTES_S = 100e6
"""The bandwidth assumed of a peer not measured yet."""


def drain_deadline_s(kv_bytes: int, bandwidth_bytes_s: float | None, slack: float = 4.0) -> float:
    """How long a push of `kv_bytes` may take to finish once its request is computed: `slack` times what the
    peer's measured bandwidth (or the prior) says, never under DRAIN_FLOOR_S. The measured figure is a lower
    bound (it counts a push from its first layer, so during the prefill too): the deadline errs long."""
    return DRAIN_FLOOR_S + slack * kv_bytes / (bandwidth_bytes_s or DRAIN_PRIOR_BYTES_S)


PULL_FLOOR_S = 2.0
"""The least a hot-spot pull is given: it is optional (a failed one only means computing the prefix), so a
peer that does not answer (stopped, overloaded) must cost the request little."""


def pull_deadline_s(kv_bytes: int, bandwidth_bytes_s: float | None, slack: float = 4.0) -> float:
    """How long pulling `kv_bytes` of prefix blocks may take before the prefill computes them instead."""
    return PULL_FLOOR_S + slack * kv_bytes / (bandwidth_bytes_s or DRAIN_PRIOR_BYTES_S)


class TransferError(RuntimeError):
    """A push that did not complete; the message says why. `retryable`: the receiver asks for a resend."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class ChecksumMismatch(ValueError):
    """A layer or block whose bytes do not match their checksum."""


class KVSink(Protocol):
    """Where a receiving messenger puts a pushed request's KV. Raise to refuse; abort frees.

    `begin` may be called once per stripe of the same request; it must accept the later ones. It is a
    coroutine so that a sink may wait a moment for the request it is told about elsewhere. A sink whose
    `write` copies the chunk's bytes before returning sets `copies_bytes = True`: it is then handed views
    of a same-host sender's shared memory, which the sender reuses once the push is acknowledged; any
    other sink gets bytes of its own."""

    async def begin(self, header: kv_pb2.KVHeader) -> None: ...
    def write(self, request_id: str, chunk: kvwire.LayerData) -> None: ...
    def commit(self, request_id: str, commit: kv_pb2.KVCommit) -> None: ...
    def abort(self, request_id: str, reason: str, retryable: bool = False) -> None: ...


class BlockSource(Protocol):
    """Where a messenger serves pulled prefix blocks from."""

    def read_blocks(self, block_hashes: list[str], dtype: str, block_size: int) -> Iterator[tuple[str, bytes | None]]:
        """(hash, data) in order; data None for the first hash no longer held (the pull stops there)."""


class BlockSink(Protocol):
    """Where a messenger keeps the blocks a peer puts (PutBlocks): this node's pool."""

    def put(self, block_hash: str, depth: int, data: bytes | memoryview) -> bool:
        """Keep one block (ValueError when it is not a block of this pool); False when there is no room."""


def checksum(*parts: bytes | memoryview) -> int:
    """CRC-32C (Castagnoli) of the parts in order, on the CPU's SSE4.2/ARMv8 instructions (many times
    faster than zlib's crc32), so the check costs little next to the transfer."""
    value = 0
    for part in parts:
        value = crc32c.crc32c(part, value)
    return value


class KVTransferServicer(kv_pb2_grpc.KVTransferServicer):
    def __init__(self, sink: KVSink, source: BlockSource | None = None, pool: BlockSink | None = None,
                 gpus: Sequence[str] = (), mooncake=None) -> None:
        """`gpus`: the UUIDs of the GPUs the receiving engine computes on; `mooncake`: a
        `runtime.mooncake.MooncakeReceiver` (layers read from a sender's registered memory), or None."""
        self.sink, self.source, self.pool, self.mooncake = sink, source, pool, mooncake
        self.stats: collections.Counter[str] = collections.Counter()
        self.segments = AttachedSegments()
        """Same-host senders' shared memory, mapped here."""
        self.endpoint = Endpoint(host_id(), tuple(gpus), ("grpc", "shm") + (("mooncake",) if mooncake else ()))
        """What this messenger says of itself in `Stats`: what a pusher chooses its transport from."""

    async def PushKV(self, request_iterator, context) -> kv_pb2.PushAck:
        """Takes raw serialized KVChunks (see `add_servicer`): layers are parsed without copying."""
        header, received, done = None, 0, False
        try:
            async for data in request_iterator:
                item = kvwire.decode(data) if isinstance(data, (bytes, bytearray)) else kvwire.normalize(data)
                if isinstance(item, kv_pb2.KVHeader):
                    if header is not None:
                        raise ValueError("second header in one stream")
                    if item.shm_segment:
                        self.segments.attach(item.shm_segment)
                    header = item  # from here on a failure aborts the request
                    await self.sink.begin(header)
                elif header is None:
                    raise ValueError(f"{type(item).__name__} before the header")
                elif isinstance(item, kvwire.LayerData):
                    if item.shm_bytes and header.mooncake_segment:
                        item = await self._from_mooncake(header, item)
                    elif item.shm_bytes:
                        item = self._from_segment(header, item)
                    await self._verify(header.request_id, item)
                    self.sink.write(header.request_id, item)
                    received += item.nbytes
                else:
                    self.sink.commit(header.request_id, item)
                    done = True
                    break
            done = done or (header is not None and header.stripe > 0)  # data stripes end without commit
            if not done:
                raise ValueError("stream ended before its commit")
            self.stats["bytes_received"] += received
            self.stats["streams_received"] += 1
            return kv_pb2.PushAck(ok=True, bytes_received=received)
        except SharedMemoryUnavailable as exc:  # the sender pushes again, inline
            self.stats["shm_refused"] += 1
            self._abort(header, str(exc), retryable=True)
            header = None
            return kv_pb2.PushAck(ok=False, error=str(exc), bytes_received=received, retryable=True)
        except ChecksumMismatch as exc:
            self.stats["checksum_failures"] += 1
            self._abort(header, str(exc), retryable=True)
            header = None
            return kv_pb2.PushAck(ok=False, error=str(exc), bytes_received=received, retryable=True)
        except Exception as exc:  # noqa: BLE001 - every refusal goes back to the sender as an ack
            return kv_pb2.PushAck(ok=False, error=str(exc), bytes_received=received)
        finally:
            if not done:
                self._abort(header, "push did not complete")

    def _from_segment(self, header: kv_pb2.KVHeader, layer: kvwire.LayerData) -> kvwire.LayerData:
        """A layer whose bytes lie in the sender's segment: views of them for a sink that copies at once,
        else a copy of its own."""
        if not header.shm_segment:
            raise ValueError(f"layer {layer.layer} is in shared memory but the push names no segment")
        layer = self.segments.resolve(header.shm_segment, layer)
        self.stats["shm_bytes_received"] += layer.nbytes
        if getattr(self.sink, "copies_bytes", False):
            return layer
        return kvwire.LayerData(layer.layer, layer.token_start, layer.token_end, bytes(layer.key),
                                bytes(layer.value), layer.checksum)

    async def _from_mooncake(self, header: kv_pb2.KVHeader, layer: kvwire.LayerData) -> kvwire.LayerData:
        """A layer whose bytes lie in the sender's registered memory: read over the Transfer Engine."""
        if self.mooncake is None:
            raise ValueError("a Mooncake push, but this messenger has no Transfer Engine")
        layer = await self.mooncake.read(header.mooncake_segment, header.mooncake_base, layer)
        self.stats["mooncake_bytes_received"] += layer.nbytes
        return layer

    async def _verify(self, request_id: str, layer: kvwire.LayerData) -> None:
        """The checksum of a big layer runs in a thread (crc32c drops the GIL), so gRPC keeps receiving meanwhile."""
        if layer.nbytes >= OFFLOAD_CHECKSUM_BYTES:
            crc = await asyncio.get_running_loop().run_in_executor(None, checksum, layer.key, layer.value)
        else:
            crc = checksum(layer.key, layer.value)
        if crc != layer.checksum:
            raise ChecksumMismatch(f"checksum mismatch in layer {layer.layer} of {request_id}")

    def _abort(self, header: kv_pb2.KVHeader | None, reason: str, retryable: bool = False) -> None:
        if header is not None:
            self.sink.abort(header.request_id, reason, retryable)

    async def PullBlocks(self, request, context):
        if self.source is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this messenger holds no blocks")
            return  # abort raises; this only tells the type checker
        for block_hash, data in self.source.read_blocks(list(request.block_hashes), request.dtype,
                                                        request.block_size):
            if data is None:
                yield kv_pb2.BlockChunk(block_hash=block_hash, found=False)
                return
            self.stats["blocks_served"] += 1
            self.stats["bytes_sent"] += len(data)
            yield kv_pb2.BlockChunk(block_hash=block_hash, found=True, data=data, checksum=checksum(data))

    async def PutBlocks(self, request_iterator, context) -> kv_pb2.PushAck:
        """Blocks a peer hands over into `pool`; a corrupt or misshapen block ends the stream with an error
        (those before it are kept)."""
        if self.pool is None:
            return kv_pb2.PushAck(ok=False, error="this messenger has no pool to put blocks in")
        received = 0
        try:
            async for chunk in request_iterator:
                data = self._block_data(chunk)
                if checksum(data) != chunk.checksum:
                    self.stats["checksum_failures"] += 1
                    raise ChecksumMismatch(f"checksum mismatch in block {chunk.block_hash}")
                kept = self.pool.put(chunk.block_hash, chunk.depth, data)
                self.stats["blocks_put" if kept else "blocks_put_refused"] += 1
                received += len(data)
        except (ChecksumMismatch, ValueError, SharedMemoryUnavailable) as exc:
            return kv_pb2.PushAck(ok=False, error=str(exc), bytes_received=received)
        self.stats["bytes_put"] += received
        return kv_pb2.PushAck(ok=True, bytes_received=received)

    def _block_data(self, chunk: kv_pb2.BlockChunk) -> bytes | memoryview:
        """A put block's bytes: inline, or a view of the same-host sender's segment."""
        if not chunk.shm_segment:
            return chunk.data
        segment = self.segments.attach(chunk.shm_segment)
        end = chunk.shm_offset + chunk.shm_bytes
        if segment.buf is None or end > segment.size:
            raise ValueError(f"block {chunk.block_hash} lies beyond its shared memory segment")
        self.stats["shm_bytes_received"] += chunk.shm_bytes
        return segment.buf[chunk.shm_offset:end]

    async def PullKV(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this messenger does not serve request pulls")

    async def Stats(self, request, context) -> kv_pb2.StatsReply:
        counters = {k: v for k, v in self.stats.items() if k in STATS_FIELDS}
        return kv_pb2.StatsReply(**counters, host_id=self.endpoint.host, gpus=self.endpoint.gpus,
                                 transports=self.endpoint.transports,
                                 mooncake_segment=self.mooncake.segment if self.mooncake else "")


STATS_FIELDS = set(kv_pb2.StatsReply.DESCRIPTOR.fields_by_name) - {"host_id", "gpus", "transports",
                                                                    "mooncake_segment"}


SERVICE = "kvcentric.kv.KVTransfer"
PUSH_KV = f"/{SERVICE}/PushKV"


def add_servicer(server: grpc.aio.Server, servicer: KVTransferServicer) -> None:
    """Register KVTransfer with PushKV taking raw bytes (parsed by `kvwire`), the rest as generated."""
    handlers = {
        "PushKV": grpc.stream_unary_rpc_method_handler(
            servicer.PushKV, request_deserializer=None, response_serializer=kv_pb2.PushAck.SerializeToString),
        "PullBlocks": grpc.unary_stream_rpc_method_handler(
            servicer.PullBlocks, request_deserializer=kv_pb2.PullBlocksRequest.FromString,
            response_serializer=kv_pb2.BlockChunk.SerializeToString),
        "PutBlocks": grpc.stream_unary_rpc_method_handler(
            servicer.PutBlocks, request_deserializer=kv_pb2.BlockChunk.FromString,
            response_serializer=kv_pb2.PushAck.SerializeToString),
        "PullKV": grpc.unary_stream_rpc_method_handler(
            servicer.PullKV, request_deserializer=kv_pb2.PullRequest.FromString,
            response_serializer=kv_pb2.KVChunk.SerializeToString),
        "Stats": grpc.unary_unary_rpc_method_handler(
            servicer.Stats, request_deserializer=kv_pb2.StatsRequest.FromString,
            response_serializer=kv_pb2.StatsReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


async def start_server(servicer: KVTransferServicer, host: str, port: int,
                       more: Sequence[grpc.GenericRpcHandler] = (),
                       tls: TransferTls | None = None) -> tuple[grpc.aio.Server, int]:
    """Serve KVTransfer (and the services in `more`) on host:port (0 picks a free port); returns the server
    and its port. With `tls`, mutual TLS: a client without a certificate the deployment's CA signed is refused
    during the handshake, before any call."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    add_servicer(server, servicer)
    if more:
        server.add_generic_rpc_handlers(tuple(more))
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls.server_credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind the KV transfer port {host}:{port}")
    await server.start()
    return server, bound


WILDCARDS = ("", "0.0.0.0", "::", "[::]")


def advertised_address(host: str, port: int) -> str:
    """host:port where peers reach a server bound to `host`:`port`: `host` itself, or for a wildcard bind (0.0.0.0,
    ::) this machine's own address, so that each replica of a scaled container advertises itself."""
    if host not in WILDCARDS:
        return f"{host}:{port}"
    address = own_address()
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def own_address() -> str:
    """This machine's address for its peers: what its hostname resolves to (a container's own IP), else the source
    address of its route out (nothing is sent), else loopback."""
    try:
        resolved = socket.gethostbyname(socket.gethostname())
        if not resolved.startswith("127."):
            return resolved
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the route, sends nothing
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class TokenBucket:
    """Bytes per second with a burst allowance; `consume` waits until the bytes may go."""

    def __init__(self, rate_bytes_s: float, burst_bytes: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate_bytes_s, burst_bytes, clock
        self.tokens, self.stamp = burst_bytes, clock()

    def delay_for(self, nbytes: int) -> float:
        """Take `nbytes` and return how long to wait before sending them (0 when within budget)."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= nbytes
        return max(0.0, -self.tokens / self.rate)

    async def consume(self, nbytes: int) -> None:
        delay = self.delay_for(nbytes)
        if delay > 0:
            await asyncio.sleep(delay)


class KVPusher:
    """Client side: channels per peer reused across requests, optional striping over `stripes`
    connections, an optional per-peer rate limit, and the bandwidth each peer was measured at."""

    def __init__(self, stripes: int = 1, rate_limit_bytes_s: float = 0.0, shared_memory: bool = True,
                 tls: TransferTls | None = None, transport: str = "auto", gpus: Sequence[str] = (),
                 mooncake=None) -> None:
        """`transport`: `--kv-transport` (auto: chosen per peer, `core/kvlinks.py`); `shared_memory=False` is
        `transport="grpc"`. Striped or rate-limited pushes always go over gRPC. `tls`: every connection is mutual
        TLS (the peers' certificates checked against the deployment's CA); `gpus`: the UUIDs of the GPUs this
        engine computes on; `mooncake`: a `runtime.mooncake.MooncakeSender`, or None."""
        self.stripes, self.rate_limit, self.tls = max(1, stripes), rate_limit_bytes_s, tls
        self.transport = transport if shared_memory else "grpc"
        self.shared_memory = self.transport != "grpc" and self.stripes == 1 and not rate_limit_bytes_s
        """Whether a push may go around the gRPC stream at all (each link still chooses: `link`)."""
        self.mooncake = mooncake
        self.here = Endpoint(host_id(), tuple(gpus), ("grpc", "shm") + (("mooncake",) if mooncake else ()))
        self.links: dict[str, LinkChoice] = {}
        """Peer address -> the transport its pushes use, and why (/health's `kv_links`)."""
        self.segments = SegmentPool()
        self.inline_peers: set[str] = set()
        """Same-host peers that could not open a segment: pushed to inline."""
        self._channels: dict[tuple[str, int], grpc.aio.Channel] = {}
        self._buckets: dict[str, TokenBucket] = {}
        self.bandwidth: dict[str, float] = {}
        """Peer address -> bytes/s of its recent pushes (moving average)."""
        self.stats: collections.Counter[str] = collections.Counter()

    def _channel(self, addr: str, stripe: int = 0) -> grpc.aio.Channel:
        channel: grpc.aio.Channel | None = self._channels.get((addr, stripe))
        if channel is None:  # a distinct option per stripe keeps gRPC from sharing one connection
            options = CHANNEL_OPTIONS + [("grpc.use_local_subchannel_pool", 1), ("kvc.stripe", stripe)]
            channel = self._channels[(addr, stripe)] = open_channel(addr, self.tls, options)
        return channel

    def stub(self, addr: str, stripe: int = 0) -> kv_pb2_grpc.KVTransferStub:
        return kv_pb2_grpc.KVTransferStub(self._channel(addr, stripe))

    async def _paced(self, addr: str, items: AsyncIterator[kvwire.Item]) -> AsyncIterator[bytes]:
        """Serialized chunks, each layer only once the peer's token bucket lets its bytes go."""
        bucket = self._buckets.get(addr)
        if bucket is None and self.rate_limit > 0:
            bucket = self._buckets[addr] = TokenBucket(self.rate_limit, max(self.rate_limit * 0.05, 1 << 20))
        async for item in items:
            if isinstance(item, kvwire.LayerData):
                if bucket is not None:
                    await bucket.consume(item.nbytes)
                self.stats["bytes_streamed"] += item.nbytes
            yield kvwire.encode(item)

    async def _call(self, addr: str, stripe: int, items: AsyncIterator[kvwire.Item], timeout_s: float,
                    metadata: list | None = None) -> int:
        push = self._channel(addr, stripe).stream_unary(PUSH_KV, request_serializer=None,
                                                         response_deserializer=kv_pb2.PushAck.FromString)
        try:
            ack = await push(self._paced(addr, items), timeout=timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise TransferError(f"KV push to {addr} failed: {exc.code().name}: {exc.details()}") from exc
        if not ack.ok:
            raise TransferError(f"KV push to {addr} refused: {ack.error}", retryable=ack.retryable)
        return ack.bytes_received

    async def link(self, addr: str) -> LinkChoice:
        """The transport pushes to `addr` use: chosen once, from what the peer's `Stats` says of itself."""
        choice = self.links.get(addr)
        if choice is not None:
            return choice
        if not self.shared_memory:
            choice = LinkChoice("grpc", "asked for" if self.transport == "grpc" else "striped or rate-limited pushes")
        else:
            choice = choose(self.transport, self.here, await self._peer(addr))
        if addr in self.links:  # another push asked meanwhile
            return self.links[addr]
        self.links[addr] = choice
        self.stats[f"links_{choice.transport.replace('-', '_')}"] += 1
        log.info("KV pushes to %s go over %s (%s)", addr, choice.transport, choice.reason)
        return choice

    async def _peer(self, addr: str) -> Endpoint | None:
        """What the messenger at `addr` says of itself (None when it does not answer in time)."""
        try:
            reply = await self.stub(addr).Stats(kv_pb2.StatsRequest(), timeout=LINK_QUERY_S)
        except grpc.aio.AioRpcError as exc:
            log.warning("KV peer %s did not say what it is (%s): pushing over gRPC", addr, exc.code().name)
            return None
        return Endpoint(reply.host_id, tuple(reply.gpus), tuple(reply.transports) or ("grpc",))

    def forget(self, addr: str) -> None:
        """Choose `addr`'s transport again at its next push (the peer failed a push: it may have been replaced)."""
        self.links.pop(addr, None)

    async def push(self, addr: str, chunks: AsyncIterator, timeout_s: float = 120.0,
                   metadata: list | None = None) -> int:
        """Stream one request's chunks (header, layers, commit: `kvwire` items or generated KVChunks) to
        the messenger at `addr`; returns bytes accepted. With several stripes, layers are dealt
        round-robin over concurrent streams."""
        chunks = _normalized(chunks)
        started = time.monotonic()
        transport = (await self.link(addr)).transport
        if transport == "shm" and addr not in self.inline_peers:
            total = await self._push_shared(addr, chunks, timeout_s, metadata)
        elif transport == "mooncake" and self.mooncake is not None:
            total = await self.mooncake.push(chunks, lambda items: self._call(addr, 0, items, timeout_s, metadata),
                                             self.stats)
        elif self.stripes == 1:
            total = await self._call(addr, 0, chunks, timeout_s, metadata)
        else:
            total = await self._push_striped(addr, chunks, timeout_s, metadata)
        self._measured(addr, total, time.monotonic() - started)
        return total

    async def _push_shared(self, addr: str, chunks: AsyncIterator[kvwire.Item], timeout_s: float,
                           metadata: list | None) -> int:
        """One stream whose layers' bytes go through a shared-memory segment, reused once acknowledged (or
        once the push failed: a receiver that gave up reads nothing more that matters)."""
        writers: list[SegmentWriter] = []

        async def placed() -> AsyncIterator[kvwire.Item]:
            async for item in chunks:
                if isinstance(item, kv_pb2.KVHeader):
                    writers.append(SegmentWriter(self.segments.acquire(push_bytes(item))))
                    header = kv_pb2.KVHeader()
                    header.CopyFrom(item)
                    header.shm_segment = writers[-1].segment.name
                    yield header
                elif isinstance(item, kvwire.LayerData) and writers:
                    item = writers[-1].put(item)
                    self.stats["shm_bytes_sent"] += 2 * item.shm_bytes
                    yield item
                else:
                    yield item
        try:
            return await self._call(addr, 0, placed(), timeout_s, metadata)
        except TransferError as exc:
            if UNAVAILABLE in str(exc):
                self.inline_peers.add(addr)
            raise
        finally:
            for writer in writers:
                self.segments.release(writer.segment)

    async def _push_striped(self, addr: str, chunks: AsyncIterator[kvwire.Item], timeout_s: float,
                            metadata: list | None) -> int:
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(self.stripes)]
        calls = [asyncio.ensure_future(self._call(addr, i, _drain(q), timeout_s, metadata))
                 for i, q in enumerate(queues)]
        try:
            total = await _deal(chunks, queues, calls[1:])
            return total + await calls[0]
        finally:
            for call in calls:
                call.cancel()

    def _measured(self, addr: str, nbytes: int, seconds: float) -> None:
        self.stats["bytes_sent"] += nbytes
        self.stats["streams_sent"] += 1
        if nbytes and seconds > 0:
            sample = nbytes / seconds
            previous = self.bandwidth.get(addr)
            self.bandwidth[addr] = sample if previous is None else 0.7 * previous + 0.3 * sample

    async def push_with_retry(self, addr: str, make_chunks: Callable[[int], AsyncIterator],
                              retries: int = 2, timeout_s: float = 120.0, metadata: list | None = None) -> int:
        """Push, and push again from scratch (make_chunks(attempt)) while the receiver says it may be resent."""
        for attempt in range(retries + 1):
            try:
                return await self.push(addr, make_chunks(attempt), timeout_s, metadata)
            except TransferError as exc:
                if not exc.retryable or attempt == retries:
                    self.forget(addr)
                    raise
                self.stats["retries"] += 1
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels.values()), return_exceptions=True)
        self._channels.clear()
        self.segments.close()
        if self.mooncake is not None:
            self.mooncake.close()


async def _normalized(chunks: AsyncIterator) -> AsyncIterator[kvwire.Item]:
    async for chunk in chunks:
        yield kvwire.normalize(chunk)


async def _drain(queue: asyncio.Queue) -> AsyncIterator[kvwire.Item]:
    while (item := await queue.get()) is not None:
        yield item


async def _deal(items: AsyncIterator[kvwire.Item], queues: list[asyncio.Queue],
                data_calls: Sequence[Awaitable[int]]) -> int:
    """Copy the header to every stripe, deal layers round-robin, and send the commit on stripe 0 only
    once every other stripe has been acknowledged. Returns the bytes the data stripes delivered."""
    layer_index, total, committed = 0, 0, False
    async for item in items:
        if isinstance(item, kv_pb2.KVHeader):
            for stripe, queue in enumerate(queues):
                header = kv_pb2.KVHeader()
                header.CopyFrom(item)
                header.stripes, header.stripe = len(queues), stripe
                queue.put_nowait(header)
        elif isinstance(item, kvwire.LayerData):
            queues[layer_index % len(queues)].put_nowait(item)
            layer_index += 1
        else:
            for queue in queues[1:]:
                queue.put_nowait(None)
            total = sum(await asyncio.gather(*data_calls))
            queues[0].put_nowait(item)
            queues[0].put_nowait(None)
            committed = True
    if not committed:  # the producer stopped early: end every stream, the receiver drops the request
        for queue in queues:
            queue.put_nowait(None)
    return total


async def pull_blocks(pusher: KVPusher, addr: str, block_hashes: list[str], host, first_depth: int, dtype: str,
                      block_size: int, timeout_s: float = 60.0) -> int:
    """Pull prefix blocks from the messenger at `addr` into `host` (a HostBlockPool); returns how many
    arrived (the peer stops at the first it no longer holds). A corrupt block raises ChecksumMismatch."""
    count = 0
    async for block_hash, data in stream_blocks(pusher, addr, block_hashes, dtype, block_size, timeout_s):
        host.put(block_hash, first_depth + count, data)
        count += 1
    return count


FETCH_RETRIES_S = (0.025, 0.05, 0.1, 0.2)
"""Waits before asking a peer again for prefix blocks it did not hold all of. An instance announces a block it has
just computed from its device cache at once, but its messenger serves blocks from the host pool, which has the block
only once the write-behind copy is collected (a prefill instance collects at its next step, or within its idle
tick of 50 ms): a pull sent in between finds the block missing. Together 0.375 s, beside a remote prefill's push."""


async def fetch_blocks(pusher: KVPusher, addr: str, block_hashes: list[str], dtype: str, block_size: int,
                       timeout_s: float = 60.0, retries_s: Sequence[float] = FETCH_RETRIES_S) -> list[bytes]:
    """Every one of `block_hashes` from the messenger at `addr`, in order (host-pool layout), asked for again after
    each of `retries_s` while the peer holds only some of them; TransferError when it still does not."""
    blocks: list[bytes] = []
    for wait_s in (*retries_s, None):
        blocks = [data async for _, data in stream_blocks(pusher, addr, block_hashes, dtype, block_size, timeout_s)]
        if len(blocks) == len(block_hashes) or wait_s is None:
            break
        await asyncio.sleep(wait_s)
    if len(blocks) < len(block_hashes):
        raise TransferError(f"{addr} holds {len(blocks)} of the {len(block_hashes)} prefix blocks asked for")
    return blocks


async def stream_blocks(pusher: KVPusher, addr: str, block_hashes: list[str], dtype: str, block_size: int,
                        timeout_s: float = 60.0) -> AsyncIterator[tuple[str, bytes]]:
    """(hash, bytes) of the leading `block_hashes` the messenger at `addr` holds, checksums verified."""
    request = kv_pb2.PullBlocksRequest(block_hashes=block_hashes, dtype=dtype, block_size=block_size)
    try:
        async for chunk in pusher.stub(addr).PullBlocks(request, timeout=timeout_s):
            if not chunk.found:
                break
            if checksum(chunk.data) != chunk.checksum:
                raise ChecksumMismatch(f"checksum mismatch in block {chunk.block_hash} from {addr}")
            pusher.stats["blocks_pulled"] += 1
            yield chunk.block_hash, chunk.data
    except grpc.aio.AioRpcError as exc:
        raise TransferError(f"pulling blocks from {addr} failed: {exc.code().name}: {exc.details()}") from exc


Block = tuple[str, int, bytes]
"""A block to put: its hash, its depth (index in its sequence) and its bytes."""


async def put_blocks(pusher: KVPusher, addr: str, blocks: Sequence[Block], timeout_s: float = 30.0) -> int:
    """Put blocks into the pool of the messenger at `addr` in one stream, their bytes through a shared-memory
    segment to a peer on this host (inline to one that cannot open it, from then on); returns the bytes it took.
    TransferError when it refused them or cannot be reached."""
    if (await pusher.link(addr)).transport == "shm" and addr not in pusher.inline_peers:
        segment = pusher.segments.acquire(sum(len(data) for _, _, data in blocks))
        try:
            return await _put(pusher, addr, _placed(blocks, segment), len(blocks), timeout_s)
        except TransferError as exc:
            if UNAVAILABLE not in str(exc):
                raise
            pusher.inline_peers.add(addr)
        finally:
            pusher.segments.release(segment)
    inline = [kv_pb2.BlockChunk(block_hash=block_hash, found=True, data=data, checksum=checksum(data), depth=depth)
              for block_hash, depth, data in blocks]
    return await _put(pusher, addr, inline, len(blocks), timeout_s)


def _placed(blocks: Sequence[Block], segment) -> list[kv_pb2.BlockChunk]:
    """The blocks' bytes copied into `segment`, and the chunks that say where."""
    chunks, offset, view = [], 0, segment.buf
    for block_hash, depth, data in blocks:
        view[offset:offset + len(data)] = data
        chunks.append(kv_pb2.BlockChunk(block_hash=block_hash, found=True, checksum=checksum(data), depth=depth,
                                        shm_segment=segment.name, shm_offset=offset, shm_bytes=len(data)))
        offset += len(data)
    return chunks


async def _put(pusher: KVPusher, addr: str, chunks: list[kv_pb2.BlockChunk], count: int, timeout_s: float) -> int:
    try:
        ack = await pusher.stub(addr).PutBlocks(iter(chunks), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise TransferError(f"putting blocks into {addr} failed: {exc.code().name}: {exc.details()}") from exc
    if not ack.ok:
        raise TransferError(f"putting blocks into {addr} refused: {ack.error}")
    pusher.stats["blocks_put"] += count
    return ack.bytes_received
