"""A prefill instance run as one stage of a pipelined prefill group (`kvcentric prefill --pipeline-group NAME
--stage i/X`, Mooncake §5.1): it holds only its slice of the layers, computes each chunk of a prompt as soon
as the previous stage's hidden states for it arrive (the first stage: as its FIFO gives it), hands its own
output on to the next stage over gRPC while it computes the next chunk, and streams its layers' KV straight
to the decode instance. The last stage samples the first token and commits the push.

Only the first stage takes jobs from NATS; a later stage learns of a request from its first chunk of hidden
states. A stage that cannot reach the next one fails the request (503), as any prefill failure.
"""

from __future__ import annotations

import asyncio
import time

from kvcentric.core.hashing import BlockHasher
from kvcentric.core.protocol import PrefillJob, SubmitAck, TokenChunk
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.service.pipeline import (NO_TOKEN, StageClient, StageEngine, StagePush, StageSteps, hidden_chunk,
                                               read_hidden, stage_handler)
from kvcentric.engine.service.steps import StepRunner
from kvcentric.engine.cores.prefill import PrefillChunk, PrefillRejected, PrefillWork
from kvcentric.engine.cores.role_steps import PrefillPass
from kvcentric.engine.cores.step import StepOutput
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.engine.service.base import EngineService
from kvcentric.engine.model.stage import StageRunner
from kvcentric.model.config import load_model_config
from kvcentric.proto import kv_pb2

from kvc_prefill.service import PrefillService, RefusingSink

STAGE_WAIT_S = 30.0
"""A later stage gives a request up when the previous stage has sent nothing for this long (or the
engine's --kv-wait-s, if shorter)."""


class StageService(PrefillService):
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        position = config.stage_position
        assert position is not None  # PrefillService makes a StageService only with --pipeline-group

        def build(config: EngineConfig, runner: ModelRunner | None) -> ModelRunner:
            return runner or StageRunner(load_model_config(config.model), position, config.num_kv_blocks,
                                         config.block_size, config.seed, config.dtype, config.device, config.onednn,
                                         config.cpu_kernels, config.gpu_kernels)

        EngineService.__init__(self, config, runner, with_host_pool=False, build=build)
        self.position = position
        self.stage_runner: StageRunner = self.runner
        self.engine: StageEngine = StageEngine(self.stage_runner, self.pool,
                                               BlockHasher(config.hash_algo, config.block_size), config.prefill_chunk)
        self.stage_steps = StepRunner(StageSteps(self.engine), self.model.run)
        self.attach(RefusingSink())
        self.messenger.more_services.append(stage_handler(self.on_hidden))
        self.reporter.pipeline = position
        self.pushes = {}
        self.pulling = 0
        self.layerkv = None  # a stage keeps whole device blocks (--layerkv with --pipeline-group is refused)
        self.next_stage = StageClient(self.pusher.tls)
        self.handing_on: dict[str, asyncio.Future] = {}
        """Per request, the send of its latest chunk's hidden states (each waits for the one before)."""

    # ---------------------------------------------------------------- jobs

    async def on_submit(self, job: PrefillJob) -> SubmitAck:
        if not self.position.first:
            return SubmitAck.refused(f"stage {self.position.index} of group {self.position.group}: jobs go to "
                                     f"stage 0")
        try:
            self.engine.check(job)
        except PrefillRejected as exc:
            return SubmitAck.refused(str(exc))
        self.spans.received(job.request_id)
        self.submit(job)  # a group computes its prefix rather than pull whole-model blocks
        return SubmitAck.accepted()

    async def on_hidden(self, chunk: kv_pb2.HiddenChunk) -> None:
        """A chunk of hidden states from the previous stage; the first one brings the job."""
        job, hidden = read_hidden(chunk, self.runner.dtype_name, self.runner.config.hidden_size)
        if job is not None:
            if job.request_id in self.intake:
                raise ValueError(f"request {job.request_id} was cancelled")
            self.engine.check(job)
            self.engine.first_cached[job.request_id] = chunk.num_cached
            self.engine.submit(job)
            self.spans.received(job.request_id)
        elif not self.engine.holds(chunk.request_id) and \
                all(q.request_id != chunk.request_id for q in self.engine.queue):
            raise ValueError(f"request {chunk.request_id} is not here")
        self.engine.receive(chunk.request_id, hidden, time.monotonic())
        self.wake.set()

    # ---------------------------------------------------------------- the work loop

    async def work_loop(self) -> None:
        while not self.stopping.is_set():
            out = self.stage_steps.schedule()
            self.fail_unstarted()
            self.fail_stalled()
            if out.idle:
                await self.reporter.publish_cache_changes()
                await self.wake.sleep(0.05)
                continue
            started = asyncio.get_running_loop().time()
            await self.prefill_chunk(out)
            await self.reporter.publish_cache_changes()
            new, cached = out.computed.chunks[0]
            self.speed.prefill(new, cached, asyncio.get_running_loop().time() - started)

    def fail_unstarted(self) -> None:
        while self.engine.failures:
            job, error = self.engine.failures.pop()
            self.engine.forget(job.request_id)
            self.counters["requests_failed_total"] += 1
            self.outbox.emit([TokenChunk.failed(job.request_id, f"prefill failed: {error}",
                                                prompt_tokens=len(job.token_ids), status=503)])

    def fail_stalled(self) -> None:
        limit_s = min(self.config.kv_wait_s, STAGE_WAIT_S)
        for work in self.engine.stalled(time.monotonic(), limit_s):
            self.give_up(work, f"stage {self.position.index - 1} sent nothing for {limit_s:g} s")

    def give_up(self, work: PrefillWork, error: str) -> None:
        """Fail the request (503) once; the work loop releases it at its next chunk (an empty one here)."""
        if work.cancelled:
            return
        work.cancelled = True
        self.counters["requests_failed_total"] += 1
        self.log.warning("prefill of %s failed: %s", work.request_id, error)
        self.outbox.emit([TokenChunk.failed(work.request_id, f"prefill failed: {error}",
                                            prompt_tokens=work.num_tokens, status=503)])
        push = self.pushes.get(work.request_id)
        if push is not None:
            push.task.cancel()
        self.wake.set()

    async def prefill_chunk(self, out: StepOutput[PrefillPass, int | bytes | None]) -> None:
        """Compute one chunk while its layers stream to decode (its push opened first: `open_pushes`); hand its
        hidden states on (not the last stage); the last chunk closes the push (the last stage's with the first
        token). A failure fails the request, not the service."""
        await self.stage_steps.run(out, self.open_pushes)
        plan = out.plan
        assert plan is not None
        if out.error is not None:
            work = plan.chunks[0].work
            self.end_push(work, str(out.error))
            self.fail(work, out.error)
            return
        if not plan.chunks:  # its push was gone already
            return
        chunk, result = plan.chunks[0], out.result
        if isinstance(result, bytes):
            self.hand_on(chunk.work, chunk, result)
        if chunk.last:
            self.close_chunk(chunk.work, self.pushes[chunk.work.request_id],
                             result if isinstance(result, int) else NO_TOKEN)

    def close_chunk(self, work: PrefillWork, push, token: int) -> None:
        push.finish(token, work.first_token_extras() if token != NO_TOKEN else b"")
        self.engine.complete(work)
        self.tasks.spawn(self.drain_push(work, push), f"push-{work.request_id}")

    def open_push(self, work: PrefillWork) -> None:
        self.spans.start(work.request_id, "prefill.run", prompt_tokens=work.num_tokens, cached_tokens=work.num_cached)
        self.pushes[work.request_id] = StagePush(self.runner, self.pusher, work, self.config.kv_retries,
                                                 self.spans.context(work.request_id, "prefill.run"))

    def end_push(self, work: PrefillWork, error: str = "") -> None:
        super().end_push(work, error)
        self.engine.forget(work.request_id)

    # ---------------------------------------------------------------- hidden states to the next stage

    def hand_on(self, work: PrefillWork, chunk: PrefillChunk, data: bytes) -> None:
        """Send the chunk's hidden states to the next stage behind the ones before, while this stage goes on."""
        message = hidden_chunk(work, chunk.start, chunk.end, data, self.runner.dtype_name, chunk.first)
        before = self.handing_on.get(work.request_id)
        send = asyncio.ensure_future(self._send_after(before, work, message, chunk.last))
        self.handing_on[work.request_id] = send

    async def _send_after(self, before: asyncio.Future | None, work: PrefillWork, message: kv_pb2.HiddenChunk,
                          last: bool) -> bool:
        """Whether the hidden states went out (not when an earlier chunk's did not, or the request ended)."""
        try:
            if (before is not None and not await before) or work.cancelled:
                return False
            await self.next_stage.send(work.job.pipeline_addrs[0], message)
            return True
        except Exception as exc:  # noqa: BLE001 - the request fails once, by the first send that failed
            self.give_up(work, f"handing on to the next stage: {exc}")
            return False
        finally:
            if last or work.cancelled:
                self.handing_on.pop(work.request_id, None)

    def fail(self, work: PrefillWork, exc: BaseException) -> None:
        if not work.cancelled:
            work.cancelled = True
            super().fail(work, exc)

    async def stop(self) -> None:
        await super().stop()
        await self.next_stage.close()

    def idle(self) -> bool:
        return super().idle() and not self.handing_on


PrefillService.stage_service = StageService
