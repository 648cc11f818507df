"""What the prefill and decode services share: their config, model and KV pool set-up, the in-process
messenger's gRPC server, load reports, cancel handling, and the role change of PrfaaS §3.4.3 (a
`RoleSwitch` on `kvc.control.<id>`: drain, announce the cached blocks gone, hand the loaded model to the
other role's service). The role-specific loops live in `services/prefill` and `services/decode`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import time

import torch

from kvcentric.core.block_pool import BlockPool
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.runner import ModelRunner
from kvcentric.registry import service_class
from kvcentric.engine.spans import RequestSpans
from kvcentric.engine.kvpool import HostBlockPool
from kvcentric.model.config import load_model_config
from kvcentric.engine.decode import DecodeEngine, KVRejected
from kvcentric.core.protocol import (BlockEvicted, BlockStored, Cancel, KVEventBatch, LoadReport, RoleSwitch, Subjects,
                                SubmitAck, TokenChunk, job_problem)
from kvcentric.runtime.service import Service
from kvcentric.runtime.transfer import KVPusher, KVTransferServicer, start_server


DRAIN_GRACE_S = 0.5
"""A draining instance still takes what was placed before the conductor saw its draining report."""
CANCELLED_REMEMBERED = 4096
"""How many cancelled request ids an engine remembers, to refuse a job that comes after its cancel."""
JOB_WAIT_S = 5.0
"""How long pushed KV waits for its request's DecodeJob: the conductor (or the gateway) sends the decode
and the prefill jobs at once, so the first layer can overtake the job on a fast prefill."""


class DecodeSink:
    """The messenger's sink on a node that decodes: pushed KV goes straight into the paged cache."""

    def __init__(self, service: "EngineService", engine: DecodeEngine) -> None:
        self.service, self.engine = service, engine
        self.waiting: dict[str, asyncio.Event] = {}

    def registered(self, request_id: str) -> None:
        """The request's DecodeJob is in: KV that came first may go on."""
        event = self.waiting.get(request_id)
        if event is not None:
            event.set()

    def cancelled(self, request_id: str) -> None:
        """The request was cancelled: KV waiting for its job gives up now, not after JOB_WAIT_S (the prefill
        pushing it would wait as long)."""
        self.registered(request_id)

    async def begin(self, header) -> None:
        if header.dtype != self.service.runner.dtype_name:
            raise KVRejected(f"KV dtype {header.dtype}, this instance runs {self.service.runner.dtype_name}")
        if header.request_id not in self.engine.requests:
            await self._job_of(header.request_id)
        self.engine.begin_kv(header.request_id, header.num_tokens, header.num_layers, header.token_ids,
                             join=header.stripes > 1)

    async def _job_of(self, request_id: str) -> None:
        event = self.waiting.setdefault(request_id, asyncio.Event())
        self.service.counters["kv_before_job_total"] += 1
        try:
            if request_id not in self.service.cancelled:
                async with asyncio.timeout(JOB_WAIT_S):
                    await event.wait()
        except TimeoutError:
            raise KVRejected(f"request {request_id} is not expected here (no job in {JOB_WAIT_S:g} s)") from None
        finally:
            self.waiting.pop(request_id, None)
        if request_id in self.service.cancelled and request_id not in self.engine.requests:
            raise KVRejected(f"request {request_id} was cancelled")

    def write(self, request_id: str, chunk) -> None:
        self.engine.write_kv(request_id, chunk.layer, chunk.token_start, chunk.token_end, chunk.key, chunk.value)

    def commit(self, request_id: str, commit) -> None:
        spans = self.service.spans
        spans.end(request_id, "decode.queue")
        spans.start(request_id, "decode.generate").add_event("first_token", {"kvc.token": commit.first_token})
        self.service.emit(self.engine.commit_kv(request_id, commit.first_token))
        self.service.wake.set()

    def abort(self, request_id: str, reason: str, retryable: bool = False) -> None:
        if retryable:
            self.engine.reset_kv(request_id)
        else:
            self.service.emit([self.engine.abort(request_id, "error", f"KV transfer failed: {reason}")])


class HostPoolSource:
    """The messenger's block source: prefix blocks served from this node's host pool (for pulls)."""

    def __init__(self, host: HostBlockPool, runner) -> None:
        self.host, self.runner = host, runner

    def read_blocks(self, block_hashes: list[str], dtype: str, block_size: int):
        if dtype != self.runner.dtype_name or block_size != self.runner.block_size:
            raise ValueError(f"blocks here are {self.runner.dtype_name} x {self.runner.block_size} tokens, "
                             f"asked for {dtype} x {block_size}")
        for index, block_hash in enumerate(block_hashes):
            data = self.host.read(block_hash, index)
            yield block_hash, data
            if data is None:
                return


class EngineService(Service):
    """Base of the two engine roles; subclasses provide the KV sink and the work loop."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        """`runner`: the model (weights and paged KV memory) of the service this one takes over from."""
        super().__init__(config)
        self.config: EngineConfig = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.runner = runner or ModelRunner(load_model_config(config.model), config.num_kv_blocks,
                                            config.block_size, config.seed, config.dtype, config.device)
        self.pool = BlockPool(config.num_kv_blocks, config.block_size)
        host_blocks = (config.host_pool_mb << 20) // self.runner.block_bytes
        self.host = HostBlockPool(host_blocks, self.runner.block_bytes, config.host_pool_policy) \
            if host_blocks and self.role != "decode" else None
        # One worker thread runs the model so the event loop keeps serving NATS and gRPC meanwhile.
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-model")
        self.wake = asyncio.Event()
        self.kv_addr = ""
        self._grpc = None
        self.outbox: asyncio.Queue[TokenChunk] = asyncio.Queue()
        self.spans = RequestSpans()
        self.pusher = KVPusher(config.kv_stripes, config.kv_rate_limit_gbps * 1e9 / 8)
        """The messenger's client side: pushes to decode peers, pulls from block holders."""
        self.draining_to: str | None = None
        """The role this instance is draining to, while a role change is under way."""
        self.next_role: str | None = None
        """Set when the drain is done: the process goes on as this role (`successor`)."""
        self.cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
        """The last CANCELLED_REMEMBERED request ids cancelled: a job that arrives after its cancel (the
        conductor dispatches it while the gateway, a different sender, cancels) is refused."""

    def kv_sink(self):
        raise NotImplementedError

    def load_report(self) -> LoadReport:
        raise NotImplementedError

    def idle(self) -> bool:
        """Nothing queued, running or in transfer (a drain waits for this)."""
        raise NotImplementedError

    async def on_cancel(self, cancel: Cancel) -> None:
        raise NotImplementedError

    async def _cancel(self, cancel: Cancel) -> None:
        self.cancelled[cancel.request_id] = None
        if len(self.cancelled) > CANCELLED_REMEMBERED:
            self.cancelled.popitem(last=False)
        await self.on_cancel(cancel)

    async def subscribe_jobs(self, role: str, kind, handler) -> None:
        """Take `kind` jobs on kvc.<role>.<id>.submit with `handler`; a bad one, or one whose request was
        cancelled before it came, is refused in the ack."""
        async def take(job) -> SubmitAck:
            problem = job_problem(job.request_id, job.sampling)
            if problem:
                self.counters["bus_drops_total"] += 1
                return SubmitAck.refused(problem)
            if job.request_id in self.cancelled:
                self.counters["jobs_after_cancel_total"] += 1
                return SubmitAck.refused(f"request {job.request_id} was cancelled before its job arrived")
            return await handler(job)

        await self.subscribe(Subjects.submit(role, self.instance_id), kind, take,
                             bad_reply=SubmitAck.refused)

    async def work_loop(self) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        source = HostPoolSource(self.host, self.runner) if self.host is not None else None
        self.transfer = KVTransferServicer(self.kv_sink(), source)
        self._grpc, port = await start_server(self.transfer, self.config.kv_host, self.config.kv_port)
        self.kv_addr = self.config.kv_advertise or f"{self.config.kv_host}:{port}"
        await self.subscribe(Subjects.CANCEL_ALL, Cancel, self._cancel)
        await self.subscribe(Subjects.control(self.instance_id), RoleSwitch, self.on_role_switch,
                             bad_reply=SubmitAck.refused)
        self.spawn(self.every(self.config.load_interval_s, self.report_load), "load-reports")
        self.spawn(self.send_outbox(), "outbox")
        self.spawn(self.work_loop(), "work-loop")

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)
        self.executor.shutdown(wait=False, cancel_futures=True)
        await self.pusher.close()

    async def report_load(self) -> None:
        await self.publish(Subjects.load(self.role, self.instance_id), self.load_report())

    # ---------------------------------------------------------------- role change (PrfaaS §3.4.3)

    async def on_role_switch(self, command: RoleSwitch) -> SubmitAck:
        """Drain, then serve as `command.role`; answered at once (the drain goes on in the background)."""
        if self.role not in ("prefill", "decode"):
            return SubmitAck.refused(f"a {self.role} instance serves both roles; it does not switch")
        if command.role == self.role and self.draining_to is None:
            return SubmitAck(ok=True, error=f"already a {self.role} instance")
        if self.draining_to is not None:
            return SubmitAck(ok=self.draining_to == command.role, error=f"already draining to {self.draining_to}")
        self.draining_to = command.role
        self.counters["role_switches_total"] += 1
        self.log.info("draining to become a %s instance%s", command.role,
                      f" ({command.reason})" if command.reason else "")
        await self.report_load()  # the conductor stops placing here now, not at the next tick
        self.spawn(self.drain_then_switch(), "role-switch")
        return SubmitAck.accepted()

    async def drain_then_switch(self) -> None:
        started = time.monotonic()
        while not (self.idle() and self.outbox.empty() and time.monotonic() - started >= DRAIN_GRACE_S):
            await asyncio.sleep(0.05)
        await self.forget_cached_blocks()
        self.log.info("drained in %.2f s; switching to %s", time.monotonic() - started, self.draining_to)
        self.next_role = self.draining_to
        self.stopping.set()

    async def forget_cached_blocks(self) -> None:
        """The next role starts with an empty cache: tell kvs-meta (and conductors) these blocks are gone."""
        events = []
        for tier, hashes in (("device", list(self.pool.hash_to_block)),
                             ("dram", list(self.host.slot_of) if self.host is not None else [])):
            if hashes:
                events.append(BlockEvicted(node_id=self.instance_id, block_hashes=hashes, tier=tier))
        if events:
            await self.publish(Subjects.kv_events(self.instance_id), KVEventBatch(events=events))

    @property
    def hands_over(self) -> bool:
        return self.next_role is not None

    def successor(self) -> "EngineService | None":
        """The service this process runs next: the other role on the same model, same id and ports."""
        if self.next_role is None:
            return None
        config = dataclasses.replace(self.config, instance_id=self.instance_id)
        return service_class(self.next_role)(config, self.runner)

    def emit(self, chunks: list[TokenChunk | None]) -> None:
        """Queue token chunks for `kvc.req.<id>.out`; one sender keeps each request's chunks in order."""
        for chunk in chunks:
            if chunk is not None:
                self.outbox.put_nowait(chunk)
                if chunk.finish_reason is not None:
                    self.spans.finish(chunk.request_id, chunk.error if chunk.finish_reason == "error" else "")

    async def send_outbox(self) -> None:
        while True:
            chunk = await self.outbox.get()
            await self.publish(Subjects.out(chunk.request_id), chunk)

    async def publish_kv_events(self) -> None:
        """Announce blocks that entered or left this node's prefix cache (for kvs-meta)."""
        events = []
        for tier, pool in (("device", self.pool), ("dram", self.host)):
            stored, evicted = pool.drain_events() if pool is not None else ([], [])
            events += ([BlockEvicted(node_id=self.instance_id, block_hashes=evicted, tier=tier)] if evicted else []) + \
                      ([BlockStored(node_id=self.instance_id, block_hashes=stored, tier=tier)] if stored else [])
        if events:
            await self.publish(Subjects.kv_events(self.instance_id), KVEventBatch(events=events))

    async def run_model(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def wait_for_work(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.wake.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        self.wake.clear()

    def base_load(self, queued_requests: int, queued_tokens: int, running: int, role: str = "") -> LoadReport:
        return LoadReport(instance_id=self.instance_id, role=role or self.role, cluster=self.config.cluster,
                          kv_addr=self.kv_addr, queued_requests=queued_requests, queued_tokens=queued_tokens,
                          running=running, kv_blocks_total=self.pool.num_blocks, kv_blocks_free=self.pool.num_free,
                          ts=time.time(), link_bandwidth=dict(self.pusher.bandwidth),
                          kv_bytes_sent=self.pusher.stats["bytes_streamed"],
                          draining=self.draining_to is not None)

    def health(self) -> dict:
        return {"kv_addr": self.kv_addr, "model": self.config.model, "cluster": self.config.cluster,
                "draining_to": self.draining_to,
                "link_bandwidth": dict(self.pusher.bandwidth), "stats": self.engine_stats()}

    def engine_stats(self) -> dict:
        host = {**self.host.stats, "host_blocks": len(self.host), "host_blocks_capacity": self.host.capacity} \
            if self.host is not None else {}
        pushed = {f"push_{key}": value for key, value in self.pusher.stats.items()}
        return {**self.engine.stats, **self.transfer.stats, **host, **pushed, "kv_blocks_free": self.pool.num_free,
                "kv_blocks_total": self.pool.num_blocks}

    def gauges(self) -> dict[str, float]:
        return self.engine_stats()
