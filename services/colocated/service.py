"""The colocated service's asyncio shell: answers both prefill and decode submits for its id, runs one
prefill chunk and one decode batch per step in the model thread, and streams tokens on
`kvc.req.<id>.out`. It publishes load reports in both roles, so the conductor sees it as both; a prompt
it prefills is decoded here, with no KV transfer (pushes from a prefill instance are accepted too). On the
CPU a lane (`node.Lane`) computes queued prompts in passes of their own beside the model thread's mixed steps.
"""

from __future__ import annotations

import asyncio
import time

from kvcentric.core.protocol import Cancel, DecodeJob, PrefillJob, Role, SubmitAck
from kvcentric.engine.cores.colocated import ColocatedEngine
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.cores.decode import KVRejected
from kvcentric.engine.cores.sequence import DecodeRequest
from kvcentric.engine.service.kvsink import DecodeSink
from kvcentric.engine.cores.layerkv import layer_wise
from kvcentric.engine.cores.mixed import MixedStep, MixedStepper, lane_prompt_share
from kvcentric.engine.service.node import Wakeup
from kvcentric.engine.cores.prefill import PrefillChunk, PrefillRejected
from kvcentric.engine.service.reporter import Load, prefills_of
from kvcentric.engine.service.base import EngineService


class ColocatedService(EngineService):
    role = "colocated"

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, with_host_pool=not config.layerkv)
        self.layerkv = layer_wise(self.runner, config) if config.layerkv else None
        if self.layerkv is not None:
            self.pool = self.layerkv.pool
        self.engine = ColocatedEngine(self.runner, self.pool, config.hasher(),
                                      config.prefill_chunk, config.max_batch, self.host, self.layerkv,
                                      config.layerwise_prefix_load, config.layerwise_store)
        self.stepper = MixedStepper(self.engine, config.step_tokens, config.decode_attention) \
            if config.step_tokens and self.layerkv is None else None
        """Mixed steps (one forward pass for decode rows and prompt chunks); LayerKV's layer-wise KV runs
        split steps only."""
        self.lane_wake = Wakeup()
        """Set when a prompt is queued and when a mixed step with prompt chunks starts: the lane looks then."""
        if self.lanes:
            self.model.add_lane(self.role)
            self.runner.model.look = self.model.refresh  # the model thread gives the lane a core within a step
        self.attach(DecodeSink(self.engine.decode, self.counters, self.intake, self.spans, self.outbox.emit,
                               self.wake))
        """Its role change refuses every RoleSwitch: a colocated instance serves both roles already."""

    async def take_jobs(self) -> None:
        await self.intake.take_jobs(self.bus, "prefill", self.instance_id, PrefillJob, self.on_prefill)
        await self.intake.take_jobs(self.bus, "decode", self.instance_id, DecodeJob, self.on_decode)

    # ---------------------------------------------------------------- jobs and cancels

    async def on_decode(self, job: DecodeJob) -> SubmitAck:
        try:
            self.engine.decode.add(job, time.monotonic())
        except KVRejected as exc:
            return SubmitAck.refused(str(exc))
        return SubmitAck.accepted()

    async def on_prefill(self, job: PrefillJob) -> SubmitAck:
        if job.decode_id != self.instance_id:
            return SubmitAck.refused(f"a colocated instance decodes what it prefills: decode on {self.instance_id}, "
                                     f"not {job.decode_id}")
        if self.layerkv is not None and job.sampling.n > 1:
            return SubmitAck.refused("--layerkv serves one sequence per request (n = 1)")
        if self.layerkv is not None and (why := self.layerkv.unplaceable(len(job.token_ids))):
            return SubmitAck.refused(why)
        # The decode side of the request comes with it: the gateway sends a colocated instance one submit.
        decode_job = None if job.request_id in self.engine.decode.requests else \
            DecodeJob(request_id=job.request_id, n_prompt_tokens=len(job.token_ids), sampling=job.sampling)
        try:
            self.engine.submit(job, decode_job)
        except PrefillRejected as exc:
            return SubmitAck.refused(str(exc))
        self.spans.received(job.request_id)  # its compute is traced: prefill.run, then decode.generate (outbox)
        self.spans.start(job.request_id, "prefill.run", prompt_tokens=len(job.token_ids))
        self.wake.set()
        self.lane_wake.set()
        return SubmitAck.accepted()

    async def on_cancel(self, cancel: Cancel) -> None:
        self.outbox.emit([self.engine.cancel(cancel.request_id)])

    # ---------------------------------------------------------------- what it tells the cluster

    async def report_load(self) -> None:
        """The same load, once as a prefill and once as a decode instance."""
        running = sum(r.state == "running" for r in self.engine.decode.requests.values())
        load = Load(len(self.engine.prefill.queue), self.engine.prefill.queued_tokens, running,
                    prefills=prefills_of(self.engine.prefill))
        roles: tuple[Role, ...] = ("prefill", "decode")
        for role in roles:
            await self.reporter.publish_load(role, load, self.messenger.addr, self.role_change.draining)

    def idle(self) -> bool:
        return not self.engine.has_work and self.outbox.empty()

    def gauges(self) -> dict[str, float]:
        layerkv = self.layerkv.gauges() if self.layerkv is not None else {}
        running, waiting = self.occupancy()
        return {**self.engine.prefill.stats, **self.engine.decode.stats, **self.messenger.stats, **layerkv,
                **self.model.stats(), "requests_running": running, "requests_waiting": waiting,
                "kv_blocks_free": self.pool.num_free, "kv_blocks_total": self.pool.num_blocks}

    def occupancy(self) -> tuple[int, int]:
        """Decode's sequences, and the prompts queued or computing on prefill (waiting for their first token)."""
        running, waiting = self.engine.decode.occupancy()
        prefill = self.engine.prefill
        return running, waiting + len(prefill.queue) + len(prefill.running)

    def preemptions(self) -> int:
        return self.engine.decode.stats["preemptions"]

    # ---------------------------------------------------------------- the work loop

    @property
    def lanes(self) -> bool:
        """Whether queued prompts may compute in passes of their own on a second model thread of one torch thread
        beside the mixed steps (--prefill-lanes 2; mixed steps on the CPU on 2 threads or more of its own, no
        core share). A team of two stalls at every op whose second thread lost its core to the services
        beside it; two lanes lose only their own time (`node.Lane`)."""
        return (self.config.prefill_lanes == 2 and self.stepper is not None and self.model.share is None
                and self.model.threads >= 2 and self.runner.device.type == "cpu")

    async def work_loop(self) -> None:
        if self.stepper is not None and self.model.lane is not None:
            await asyncio.gather(self.mixed_loop(self.stepper), self.lane_loop())
            return
        if self.stepper is not None:
            return await self.mixed_loop(self.stepper)
        while not self.stopping.is_set():
            self.outbox.emit(self.engine.decode.expire(time.monotonic()))
            chunk, batch, failed = self.engine.schedule(time.monotonic())
            self.outbox.emit(failed)
            if chunk is None and not batch:
                await self.reporter.publish_cache_changes()  # blocks the host pool took in meanwhile
                await self.wake.sleep(0.05)
                continue
            try:
                first, tokens, prefill_s, decode_s = await self.model.run(self.execute, chunk, batch)
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
                self.log.exception("colocated step failed")
                self.outbox.emit(self.engine.fail_step(chunk, batch, f"step failed: {exc}"))
                continue
            self.time_step(chunk, batch, prefill_s, decode_s)
            self.outbox.emit(self.engine.update(chunk, first, batch, tokens))
            await self.reporter.publish_cache_changes()

    def execute(self, chunk: PrefillChunk | None, batch: list[DecodeRequest]):
        """The engine's step in the model thread, its prefill chunk and its decode batch timed apart."""
        first, prefill_s = self.speed.timed(self.engine.prefill.execute, chunk) if chunk else (None, 0.0)
        tokens, decode_s = self.speed.timed(self.engine.decode.execute, batch) if batch else ([], 0.0)
        return first, tokens, prefill_s, decode_s

    def time_step(self, chunk: PrefillChunk | None, batch: list[DecodeRequest], prefill_s: float,
                  decode_s: float) -> None:
        if chunk is not None:
            self.speed.prefill(chunk.end - chunk.start, chunk.start, prefill_s)
        if batch:
            self.speed.decode(len(batch), sum(r.context_tokens for r in batch), decode_s)
        if self.layerkv is not None:
            self.layerkv.observe_prefill(chunk.end - chunk.start if chunk else 0, chunk.start if chunk else 0,
                                         prefill_s)
            self.layerkv.observe_decode(decode_s if batch else 0.0)

    async def mixed_loop(self, stepper: MixedStepper) -> None:
        """The work loop with `--step-tokens`: one forward pass per step for the decode batch and prompt chunks."""
        while not self.stopping.is_set():
            self.outbox.emit(self.engine.decode.expire(time.monotonic()))
            step, failed = stepper.schedule(self.prompt_share())
            self.outbox.emit(failed)
            if step.empty:
                await self.reporter.publish_cache_changes()
                await self.wake.sleep(0.05)
                continue
            computing = {chunk.work.request_id for chunk in step.chunks}
            self.engine.prefill.computing |= computing
            if step.chunks:  # a step of decode rows alone keeps both threads: a prompt waits for the next
                self.model_step.set()
                self.lane_wake.set()
            try:
                (firsts, tokens), seconds = await self.model.run(self.speed.timed, stepper.execute, step)
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
                self.log.exception("colocated step failed")
                self.outbox.emit(stepper.fail_step(step, f"step failed: {exc}"))
                continue
            finally:
                self.engine.prefill.computing -= computing
                self.model_step.clear()
            self.time_mixed_step(step, seconds)
            self.outbox.emit(stepper.update(step, firsts, tokens))
            await self.reporter.publish_cache_changes()

    def prompt_share(self) -> float:
        """The share of its prompt budget the model thread's next mixed step takes (`lane_prompt_share`)."""
        lane = self.model.lane
        if lane is None:
            return 1.0
        return lane_prompt_share(self.config.step_tokens, self.model.threads, lane.computing,
                                 self.engine.prefill.waiting_tokens)

    def time_mixed_step(self, step: MixedStep, seconds: float) -> None:
        """Feed the cost model: a step's time shared between its prompt chunks and its decode batch by tokens."""
        share = seconds / (step.prefill_tokens + len(step.batch))
        for chunk in step.chunks:
            self.speed.prefill(chunk.end - chunk.start, chunk.start, share * (chunk.end - chunk.start))
        if step.batch:
            self.speed.decode(len(step.batch), sum(r.context_tokens for r in step.batch), share * len(step.batch))

    async def lane_loop(self) -> None:
        """The lane's steps: while the model thread computes a mixed step with prompt chunks and more prompts
        wait, chunks of as many of them as --step-tokens holds in one pass on the lane's thread; a prompt whose
        last chunk it computes is handed to the decode batch of the model thread's next step. Beside a step of
        decode rows alone the lane takes nothing: at concurrency 8 a prompt computed there on one thread, with
        the decode rows on the other, cost output tokens/s against waiting for the next mixed step on both
        (docs/performance-notebook.md, "What serving adds to a prompt's prefill")."""
        prefill = self.engine.prefill
        while not self.stopping.is_set():
            if not self.model_step.is_set() or not self.prompts_waiting():
                await self.lane_wake.sleep(0.5)  # no polling: a wake-up mid-step would stall the model's team
                continue
            chunks = prefill.schedule_step(self.config.step_tokens)
            if not chunks:
                await self.lane_wake.sleep(0.5)
                continue
            computing = {chunk.work.request_id for chunk in chunks}
            prefill.computing |= computing
            try:
                firsts, seconds = await self.model.run_lane(self.speed.timed, prefill.execute_step, chunks,
                                                            [None] * len(chunks))
            except Exception as exc:  # noqa: BLE001 - fail this pass's requests, keep serving
                self.log.exception("colocated lane pass failed")
                for chunk in chunks:
                    self.outbox.emit(self.engine.fail_step(chunk, [], f"step failed: {exc}"))
                continue
            finally:
                prefill.computing -= computing
            tokens = sum(chunk.end - chunk.start for chunk in chunks)
            for chunk, first in zip(chunks, firsts):  # two passes at once: the queue moves at twice one's pace
                share = seconds / 2 * (chunk.end - chunk.start) / tokens
                self.speed.prefill(chunk.end - chunk.start, chunk.start, share)
                self.outbox.emit(self.engine.update(chunk, first, [], []))
            await self.reporter.publish_cache_changes()
            self.wake.set()

    def prompts_waiting(self) -> bool:
        """More prompt tokens wait (queued, or in progress and not computed now) than the next mixed step takes:
        fewer, and that step computes them on both threads."""
        return self.engine.prefill.waiting_tokens > self.config.step_tokens
