"""The prefill service's asyncio shell: takes jobs from NATS, runs the prefill engine chunk by chunk in
the model thread, and pushes each layer's KV to the decode instance's messenger over gRPC as soon as
that layer of the chunk is computed, so the transfer overlaps the remaining layers and chunks. A computed
request's push finishes beside the next jobs, so a slow or stopped receiver delays no one else. With
--layerkv a prompt whose KV does not fit in device blocks starts with some of its layers in host memory
(LayerKV, `engine/cores/layerkv.py`); its layers stream out as they are computed, wherever they are kept.
"""

from __future__ import annotations

import asyncio
import time
from typing import ClassVar

from kvcentric.core.protocol import Cancel, PrefillJob, Role, SubmitAck, TokenChunk
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.cores.layerkv import layer_wise
from kvcentric.engine.cores.prefill import PrefillChunk, PrefillEngine, PrefillRejected, PrefillWork
from kvcentric.engine.cores.role_steps import PrefillPass, PrefillSteps, failed_prefill
from kvcentric.engine.cores.step import Computed, StepOutput, token_shares
from kvcentric.engine.model.llama import LayerHook
from kvcentric.engine.service.reporter import Load, prefills_of
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.engine.service.streaming import RequestPush
from kvcentric.engine.service.base import EngineService
from kvcentric.engine.service.steps import PrefillLaneGate, StepRunner
from kvcentric.runtime.service import Service
from kvcentric.runtime.transfer import TransferError, drain_deadline_s, pull_blocks, pull_deadline_s


class RefusingSink:
    """A prefill node's messenger takes no pushes (it sends them)."""

    async def begin(self, header):
        raise ValueError("this is a prefill instance; push KV to a decode instance")

    def write(self, request_id, chunk): ...
    def commit(self, request_id, commit): ...
    def abort(self, request_id, reason, retryable=False): ...


class PrefillService(EngineService):
    role: Role = "prefill"
    stage_service: ClassVar[type[PrefillService] | None] = None
    """What an instance with --pipeline-group runs: a stage of a prefill group (`stage.py` names it here)."""

    def __new__(cls, config: EngineConfig, runner: ModelRunner | None = None):
        if cls is PrefillService and config.pipeline_group:
            if cls.stage_service is None:
                raise RuntimeError("kvc_prefill.stage is not loaded")
            return super().__new__(cls.stage_service)
        return super().__new__(cls)

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        """`runner`: the model (weights and paged KV memory) of the service this one takes over from."""
        super().__init__(config, runner, with_host_pool=not config.layerkv)
        self.layerkv = layer_wise(self.runner, config) if config.layerkv else None
        """With --layerkv: the pool is LayerKV's, and a prompt starts once its layers are placed."""
        if self.layerkv is not None:
            self.pool = self.layerkv.pool
        self.engine = PrefillEngine(self.runner, self.pool, config.hasher(),
                                    config.prefill_chunk, self.host, config.layerwise_prefix_load,
                                    config.layerwise_store)
        if self.lanes:
            self.model.add_lane(self.role)
        core = PrefillSteps(self.engine, config.prefill_step_tokens, self.layerkv, time.monotonic,
                            self.speed.slow_down)
        self.steps = StepRunner(core, self.model.run)
        self.lane_steps = StepRunner(core, self.model.run_lane) if self.model.lane is not None else None
        """The lane's steps: the same core, computed in the lane's thread."""
        self.lane_gate = PrefillLaneGate(self.engine.queue, self.model.share)
        self.attach(RefusingSink())
        self.pushes: dict[str, RequestPush] = {}
        self.pulling = 0

    async def take_jobs(self) -> None:
        await self.intake.take_jobs(self.bus, self.role, self.instance_id, PrefillJob, self.on_submit)

    # ---------------------------------------------------------------- jobs and cancels

    async def on_submit(self, job: PrefillJob) -> SubmitAck:
        try:
            self.engine.check(job)
        except PrefillRejected as exc:
            return SubmitAck.refused(str(exc))
        if self.layerkv is not None and (why := self.layerkv.unplaceable(len(job.token_ids))):
            return SubmitAck.refused(why)
        self.spans.received(job.request_id)
        if job.pull_block_hashes and job.kv_source_addr and self.host is not None:
            self.tasks.spawn(self.pull_then_submit(job), f"pull-{job.request_id}")
        else:
            self.submit(job)
        return SubmitAck.accepted()

    def submit(self, job: PrefillJob) -> None:
        try:
            self.engine.submit(job)
        except PrefillRejected as exc:  # a duplicate that slipped in while its blocks were pulled
            self.outbox.emit([TokenChunk.failed(job.request_id, str(exc), prompt_tokens=len(job.token_ids))])
            return
        self.wake.set()

    async def pull_then_submit(self, job: PrefillJob) -> None:
        """Hot-spot replication (Mooncake Algorithm 1): copy the prefix blocks the conductor named from
        their holder into this node's pool, then prefill; a failed pull only means more to compute."""
        try:
            depth = self.engine.hashes(job.token_ids).index(job.pull_block_hashes[0])
        except ValueError:
            depth = 0
        self.pulling += 1
        try:
            assert self.host is not None
            deadline_s = pull_deadline_s(len(job.pull_block_hashes) * self.host.block_bytes,
                                         self.pusher.bandwidth.get(job.kv_source_addr))
            async with asyncio.timeout(deadline_s):  # a peer that does not answer: compute the prefix instead
                pulled = await pull_blocks(self.pusher, job.kv_source_addr, job.pull_block_hashes, self.host,
                                           depth, self.runner.dtype_name, self.runner.block_size, deadline_s)
            self.counters["blocks_pulled_total"] += pulled
        except Exception as exc:  # noqa: BLE001 - fall back to computing the prefix
            self.counters["pulls_failed_total"] += 1
            self.log.warning("pulling %d blocks from %s failed: %s", len(job.pull_block_hashes),
                             job.kv_source_addr, exc)
        finally:
            self.pulling -= 1
        if job.request_id in self.intake:  # cancelled while its blocks were pulled
            self.log.info("cancelled %s", job.request_id)
            return
        self.submit(job)

    async def on_cancel(self, cancel: Cancel) -> None:
        """Drop the job if queued; if running, stop it at its next chunk, and its push now (a last push
        waiting on its receiver would otherwise hold the work loop until the push deadline)."""
        if self.engine.cancel(cancel.request_id):
            self.log.info("cancelled %s", cancel.request_id)
            push = self.pushes.get(cancel.request_id)
            if push is not None:  # the work loop sees the cancel on its next await of the push
                push.task.cancel()

    # ---------------------------------------------------------------- what it tells the cluster

    async def report_load(self) -> None:
        load = Load(len(self.engine.queue), self.engine.queued_tokens, len(self.engine.running),
                    prefills=prefills_of(self.engine))
        await self.reporter.publish_load(self.role, load, self.messenger.addr, self.role_change.draining)

    def idle(self) -> bool:
        """Nothing queued, running, in transfer or still to send (a drain waits for this)."""
        writing = self.engine.writer is not None and self.engine.writer.busy
        busy = self.engine.queue or self.engine.running or self.engine.sending or self.pushes or self.pulling or \
            writing
        return not busy and self.outbox.empty()

    def gauges(self) -> dict[str, float]:
        work = {"requests_queued": len(self.engine.queue), "requests_running": len(self.engine.running),
                # T_queue as this engine predicts it (0 before it has measured itself): what an autoscaler of the
                # prefill pool reads (deploy/k8s/components/autoscaling)
                "prefill_queue_time_s": max(0.0, self.reporter.est_queue_s)}
        layerkv = self.layerkv.gauges() if self.layerkv is not None else {}
        return {**self.engine.stats, **work, **self.messenger.stats, **self.reporter.stats(), **layerkv,
                **self.model.stats()}

    def occupancy(self) -> tuple[int, int]:
        return len(self.engine.running), len(self.engine.queue)

    def successor(self) -> Service | None:
        if self.layerkv is not None:  # the next role runs the model over whole device blocks
            self.layerkv.layered.detach()
        return super().successor()

    # ---------------------------------------------------------------- the work loop

    async def work_loop(self) -> None:
        if self.lane_steps is None:
            await self.step_loop(self.steps)
            return
        await asyncio.gather(self.step_loop(self.steps), self.step_loop(self.lane_steps, lane=True))

    async def step_loop(self, steps: StepRunner[PrefillPass, list[int | None]], lane: bool = False) -> None:
        """Steps one after the other: in the model thread, or with `lane` in the lane's thread beside it, which
        takes a prompt only while the model thread computes one and a core is lent (`PrefillLaneGate`)."""
        while not self.stopping.is_set():
            if lane and not self.lane_gate.may_start():
                await self.lane_gate.wait()
                continue
            out = steps.schedule()
            if out.idle:
                if lane:
                    await self.lane_gate.wait()
                    continue
                await self.reporter.publish_cache_changes()  # blocks the host pool took in meanwhile
                await self.wake.sleep(0.05)
                continue
            started = time.perf_counter()  # the step's whole turn, as the queue behind it sees it
            if self.model.share is not None:
                self.model.share.waiting(len(self.engine.queue))
            if not lane:
                self.lane_gate.begin()
            try:
                await self.prefill_step(steps, out)
            finally:
                if not lane:
                    self.lane_gate.end()
            await self.reporter.publish_cache_changes()
            self.time_step(out.computed, time.perf_counter() - started, lane)

    def time_step(self, computed: Computed, seconds: float, lane: bool) -> None:
        """Feed the cost model: a shared pass is timed to its chunks by their tokens."""
        if self.model.lane is not None and (self.model.lane.computing or lane):
            seconds /= 2  # two passes at once: the queue behind them moves at twice this one's pace
        shares, _ = token_shares(seconds, computed)
        for (new, cached), share in zip(computed.chunks, shares):
            self.speed.prefill(new, cached, share)
            if self.layerkv is not None:
                self.layerkv.observe_prefill(new, cached, share)

    @property
    def lanes(self) -> bool:
        """Whether two prompts may compute at once, each on a model thread of its own (--prefill-lanes 2, on the
        CPU, with cores lent; not with LayerKV, nor in a stage of a prefill pipeline)."""
        share = self.model.share
        return (self.config.prefill_lanes == 2 and share is not None and share.takes and self.layerkv is None
                and self.runner.device.type == "cpu" and type(self) is PrefillService)

    async def prefill_step(self, steps: StepRunner[PrefillPass, list[int | None]],
                           out: StepOutput[PrefillPass, list[int | None]]) -> None:
        """Compute one step's chunks in one pass while each prompt's layers stream to its decode instance; a
        prompt's first chunk opens its push, its last closes it with the first token. Any failure fails the
        requests it concerns, not the service: a cancelled or already failed push only its own."""
        await steps.run(out, self.open_pushes)
        plan = out.plan
        assert plan is not None
        if out.error is not None:
            for chunk in plan.chunks:
                self.end_push(chunk.work, str(out.error))
                self.failed(chunk.work, out.error)
            self.outbox.emit(out.chunks)
            return
        if out.result is None:  # every push was gone already
            return
        for chunk, token in zip(plan.chunks, out.result):
            work = chunk.work
            self.spans.get(work.request_id, "prefill.run").add_event("chunk", {"kvc.start": chunk.start,
                                                                                "kvc.end": chunk.end})
            if chunk.last:
                assert token is not None
                push = self.pushes[work.request_id]
                push.finish(token, work.first_token_extras())
                self.tasks.spawn(self.drain_push(work, push), f"push-{work.request_id}")

    async def open_pushes(self, plan: PrefillPass) -> bool:
        """Each chunk's push (its prompt's first opens it) and its layer hook; a chunk whose push is gone is dropped
        (and its request failed, unless cancelled). Whether any chunk is left to compute."""
        live: list[PrefillChunk] = []
        hooks: list[LayerHook | None] = []
        for chunk in plan.scheduled:
            try:
                push = await self.chunk_push(chunk)
            except asyncio.CancelledError:
                if not chunk.work.cancelled:
                    raise
                self.end_push(chunk.work)
                continue
            except Exception as exc:  # noqa: BLE001 - the request fails, the service lives on
                self.end_push(chunk.work, str(exc))
                self.fail(chunk.work, exc)
                continue
            live.append(chunk)
            hooks.append(push.hook(chunk.start))
        plan.chunks, plan.hooks = live, hooks
        return bool(live)

    async def chunk_push(self, chunk: PrefillChunk) -> RequestPush:
        """The request's push for this chunk (opened at its first); raises CancelledError for a cancelled
        request, and the push's error when its receiver gave up already (now, not after the prompt)."""
        if chunk.first:
            self.open_push(chunk.work)
        push = self.pushes[chunk.work.request_id]
        if chunk.work.cancelled:
            raise asyncio.CancelledError
        if push.failed_early:
            await push.task
        return push

    async def drain_push(self, work: PrefillWork, push: RequestPush) -> None:
        """The rest of a computed request's push, beside the next jobs (no head-of-line blocking): a receiver
        that has not taken it all within a deadline set from its bytes and the peer's measured bandwidth is
        given up on, and only this request fails. Its blocks stay held until then (a resend reads them)."""
        kv_bytes = (work.num_tokens - work.job.kv_skip_tokens) * 2 * self.runner.config.num_layers * \
            self.runner.layer_token_bytes
        deadline_s = drain_deadline_s(kv_bytes, self.pusher.bandwidth.get(work.job.decode_kv_addr))
        try:
            async with asyncio.timeout(deadline_s):
                await push.task
        except TimeoutError:
            self.counters["pushes_given_up_total"] += 1
            error = TransferError(f"KV push to {work.job.decode_kv_addr} not taken within {deadline_s:.1f} s")
            self.end_push(work, str(error))
            self.fail(work, error)
        except asyncio.CancelledError:
            if not work.cancelled:
                raise
            self.end_push(work)
        except Exception as exc:  # noqa: BLE001 - the request fails, the service lives on
            self.end_push(work, str(exc))
            self.fail(work, exc)
        else:
            self.end_push(work)

    def open_push(self, work: PrefillWork) -> None:
        """Start the request's span and its KV push to the decode instance."""
        self.spans.start(work.request_id, "prefill.run", prompt_tokens=work.num_tokens,
                         cached_tokens=work.num_cached)
        self.pushes[work.request_id] = RequestPush(self.runner, self.pusher, work, self.config.kv_retries,
                                                   self.spans.context(work.request_id, "prefill.run"),
                                                   pool_addr=self.messenger.addr if self.host is not None else "")

    def end_push(self, work: PrefillWork, error: str = "") -> None:
        """Stop the push (if still running), release the prompt's blocks, close its spans."""
        self.spans.finish(work.request_id, error)
        push = self.pushes.pop(work.request_id, None)
        if push is not None:
            push.cancel()
        if self.engine.holds(work.request_id):
            self.engine.finish(work)

    def fail(self, work: PrefillWork, exc: BaseException) -> None:
        self.failed(work, exc)
        self.outbox.emit([failed_prefill(work, exc)])

    def failed(self, work: PrefillWork, exc: BaseException) -> None:
        """Count and log a request whose prefill failed (its last chunk goes out with the others)."""
        self.counters["requests_failed_total"] += 1
        self.log.warning("prefill of %s failed: %s", work.request_id, exc)
