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
from kvcentric.engine.service.kvsink import DecodeSink
from kvcentric.engine.cores.layerkv import layer_wise
from kvcentric.engine.cores.mixed import MixedStep, MixedStepper
from kvcentric.engine.cores.prefill import PrefillRejected
from kvcentric.engine.cores.role_steps import LanePasses, MixedSteps, SplitResult, SplitSteps
from kvcentric.engine.cores.step import Computed, StepOutput, token_shares
from kvcentric.engine.service.reporter import Load, prefills_of
from kvcentric.engine.service.base import EngineService
from kvcentric.engine.service.steps import ColocatedLaneGate, StepRunner


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
        self.lane_gate = ColocatedLaneGate(self.engine.prefill, config.step_tokens, self.model)
        self.steps = self.step_runner()
        self.lane_steps: StepRunner | None = None
        if self.lanes:
            self.model.add_lane(self.role)
            self.runner.model.look = self.model.refresh  # the model thread gives the lane a core within a step
            self.lane_steps = StepRunner(LanePasses(self.engine, config.step_tokens), self.model.run_lane,
                                         self.speed.timed)
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
        self.lane_gate.wake.set()
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

    def step_runner(self) -> StepRunner:
        """The model thread's steps: mixed with --step-tokens (timed as one pass), else a prefill chunk and a decode
        batch each timed apart (`SplitSteps`)."""
        if self.stepper is None:
            return StepRunner(SplitSteps(self.engine, time.monotonic, self.speed.timed), self.model.run)
        return StepRunner(MixedSteps(self.stepper, time.monotonic, self.lane_gate.prompt_share), self.model.run,
                          self.speed.timed)

    @property
    def lanes(self) -> bool:
        """Whether queued prompts may compute in passes of their own on a second model thread of one torch thread
        beside the mixed steps (--prefill-lanes 2; mixed steps on the CPU on 2 threads or more of its own, no
        core share). A team of two stalls at every op whose second thread lost its core to the services
        beside it; two lanes lose only their own time (`node.Lane`)."""
        return (self.config.prefill_lanes == 2 and self.stepper is not None and self.model.share is None
                and self.model.threads >= 2 and self.runner.device.type == "cpu")

    async def work_loop(self) -> None:
        if self.lane_steps is not None:
            await asyncio.gather(self.step_loop(), self.lane_loop(self.lane_steps))
            return
        await self.step_loop()

    async def step_loop(self) -> None:
        """The model thread's steps (split, or mixed with --step-tokens): their chunks out, their time to the cost
        model; a mixed step with prompt chunks lets the lane look (`ColocatedLaneGate`)."""
        while not self.stopping.is_set():
            out = self.steps.schedule()
            self.outbox.emit(out.chunks)
            if out.idle:
                await self.reporter.publish_cache_changes()  # blocks the host pool took in meanwhile
                await self.wake.sleep(0.05)
                continue
            if isinstance(out.plan, MixedStep) and out.plan.chunks:  # a step of decode rows alone keeps both threads
                self.lane_gate.begin()
            try:
                await self.steps.run(out)
            finally:
                self.lane_gate.end()
            if out.error is not None:
                self.log.error("colocated step failed", exc_info=out.error)
                self.outbox.emit(out.chunks)
                continue
            self.time_step(out)
            self.outbox.emit(out.chunks)
            await self.reporter.publish_cache_changes()

    def time_step(self, out: StepOutput) -> None:
        """Feed the cost model: a split step's prefill chunk and decode batch timed apart; a mixed step's time
        shared between its prompt chunks and its decode batch by tokens."""
        computed = out.computed
        if isinstance(out.result, SplitResult):
            self.time_parts(computed, out.result.prefill_s, out.result.decode_s)
            return
        shares, decode_s = token_shares(out.seconds, computed)
        for (new, cached), share in zip(computed.chunks, shares):
            self.speed.prefill(new, cached, share)
        if computed.rows:
            self.speed.decode(computed.rows, computed.kv_tokens, decode_s)

    def time_parts(self, computed: Computed, prefill_s: float, decode_s: float) -> None:
        for new, cached in computed.chunks:
            self.speed.prefill(new, cached, prefill_s)
        if computed.rows:
            self.speed.decode(computed.rows, computed.kv_tokens, decode_s)
        if self.layerkv is not None:
            new, cached = computed.chunks[0] if computed.chunks else (0, 0)
            self.layerkv.observe_prefill(new, cached, prefill_s)
            self.layerkv.observe_decode(decode_s if computed.rows else 0.0)

    async def lane_loop(self, steps: StepRunner) -> None:
        """The lane's steps (`LanePasses`): while the model thread computes a mixed step with prompt chunks and more
        prompts wait, chunks of as many of them as --step-tokens holds in one pass on the lane's thread. Beside a
        step of decode rows alone the lane takes nothing: at concurrency 8 a prompt computed there on one thread,
        with the decode rows on the other, cost output tokens/s against waiting for the next mixed step on both
        (docs/performance-notebook.md, "What serving adds to a prompt's prefill")."""
        while not self.stopping.is_set():
            if not self.lane_gate.may_start():
                await self.lane_gate.wait()
                continue
            out = steps.schedule()
            if out.idle:
                await self.lane_gate.wait()
                continue
            await steps.run(out)
            if out.error is not None:
                self.log.error("colocated lane pass failed", exc_info=out.error)
                self.outbox.emit(out.chunks)
                continue
            shares, _ = token_shares(out.seconds / 2, out.computed)  # two passes at once: the queue moves at twice
            for (new, cached), share in zip(out.computed.chunks, shares):  # one's pace
                self.speed.prefill(new, cached, share)
            self.outbox.emit(out.chunks)
            await self.reporter.publish_cache_changes()
            self.wake.set()
