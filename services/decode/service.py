"""The decode service's asyncio shell: registers jobs from NATS, receives their KV through the
in-process messenger's gRPC server, runs decode steps in the model thread, and streams tokens on
`kvc.req.<id>.out`. It never computes a prompt: a request starts only once all its layers arrived, and
only if the batch is predicted to keep its TBT SLO with it (--tbt-slo-s; unless set, --tbt-slo-factor 5 x the
request's unloaded step, so a request alone is never refused), else it is rejected with 429 (Mooncake §7).
Without --profile the prediction is this instance's own measured decode model, so until it has one, and while
that is a guess (calibrated on a busy machine), no request is rejected. The KV of a push that breaks off (its
prefill died mid-prompt) is kept for the request's continuation (--kv-keep-s, `engine/service/keptkv.py`).
"""

from __future__ import annotations

import collections
import logging
import time

import msgspec

from kvcentric.core.metrics import labelled
from kvcentric.core.protocol import Cancel, DecodeJob, Role, SubmitAck
from kvcentric.core.scheduling.slo import PACE_OF_SLO, TBT_FACTOR, relative_tbt_s
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.cores.decode import DecodeEngine, KVRejected
from kvcentric.engine.cores.role_steps import DecodeSteps
from kvcentric.engine.service.assembly import AssemblingSink
from kvcentric.engine.service.keptkv import KeptKV
from kvcentric.engine.service.kvsink import DecodeSink
from kvcentric.engine.service.prefixkv import PrefixPulls
from kvcentric.engine.service.reporter import Load
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.engine.service.base import EngineService
from kvcentric.engine.service.steps import Pacer, StepRunner
from kvcentric.engine.service.writeback import OutputBlocks, WriteBack

TBT_REJECTIONS = labelled("rejections_total", reason="tbt")
log = logging.getLogger("kvcentric.decode")


class CheckedDecodeSink(DecodeSink):
    """The decode sink with Mooncake's double-check: once every layer of a request is here, it joins the
    batch only if the predicted step time with it stays within --tbt-slo-s; otherwise it is rejected after
    prefill (blocks freed at once, a 429 error as its final chunk)."""

    def commit(self, request_id: str, commit) -> None:
        verdict = self.engine.check_tbt(request_id)
        if verdict.accepted:
            super().commit(request_id, commit)
            return
        self.counters[TBT_REJECTIONS] += 1
        log.debug("request %s: %s", request_id, verdict.reason)
        self.emit([self.engine.reject_kv(request_id, verdict)])


KEPT_CHECK_S = 0.2
"""How often the kept KV of broken pushes is expired and its changes announced (a continuation is placed no sooner
than the gateway's --silent-after-s after the push broke)."""

PACE_BEHIND = 2
"""Prompts queued at a prefill instance beside this one that make a decode instance with --lend-pace-s pace
itself: the prefill is then the bottleneck (a burst); with fewer (a steady closed loop) the decode steps
back to back, since its tokens are what frees the next request."""


class DecodeService(EngineService):
    role: Role = "decode"

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        """`runner`: the model (weights and paged KV memory) of the service this one takes over from."""
        super().__init__(config, runner, with_host_pool=False)
        self.prior = config.cost_model() if config.tbt_check else None
        """The model the TBT double-check starts from (read once: it parses the checkpoint's config)."""
        self.engine = DecodeEngine(self.runner, self.pool, config.max_batch, self.prior, config.tbt_slo_s,
                                   config.kv_staging_mb << 20, config.tbt_slo_factor)
        if not config.profile:  # the double-check predicts with this instance's own model, once measured
            self.engine.cost = None
        self.sink = CheckedDecodeSink(self.engine, self.counters, self.intake, self.spans, self.outbox.emit,
                                      self.wake)
        self.kept = KeptKV(self.engine, config.hasher(), config.kv_keep_s) \
            if config.kv_keep_s > 0 and self.runner.layered is None else None
        """The KV of pushes that broke off, kept for the requests' continuations and served to pulls (--kv-keep-s)."""
        self.sink.kept = self.kept
        self.attach(AssemblingSink(self.sink, self.engine), self.kept)  # KV of a prefill group comes from each stage
        self.prefix_pulls = PrefixPulls(self.pusher, self.runner.dtype_name, self.runner.block_size)
        self.sink.prefixes = self.prefix_pulls
        self.output_blocks = OutputBlocks(self.runner, config.hasher()) \
            if config.kv_write_back and self.runner.layered is None else None
        """The blocks each step fills with generated tokens' KV, for the prefill's pool (--kv-write-back)."""
        self.write_back = WriteBack(self.pusher, self.counters)
        collect = self.output_blocks.collect if self.output_blocks is not None else None
        self.steps = StepRunner(DecodeSteps(self.engine, collect), self.model.run)
        self.pacer = Pacer(self.model.share, config.lend_pace_s, self.pace_s, PACE_BEHIND)

    async def start(self) -> None:
        await super().start()
        if self.kept is not None:
            self.tasks.spawn(self.tasks.every(KEPT_CHECK_S, self.check_kept), "kept-kv")

    async def check_kept(self) -> None:
        """Forget the kept blocks whose time ran out, and announce what the cache's findable blocks became (kept,
        handed over, reused, forgotten) once it has kept any."""
        assert self.kept is not None
        self.kept.expire(time.monotonic())
        if self.kept.announces:
            await self.reporter.publish_cache_changes()

    async def take_jobs(self) -> None:
        await self.intake.take_jobs(self.bus, self.role, self.instance_id, DecodeJob, self.on_submit)
        if self.config.tbt_check:
            slo = f"{self.engine.tbt_slo_s:g} s" if self.engine.tbt_slo_s else \
                f"{self.engine.tbt_slo_factor:g}x the unloaded step"
            self.log.info("TBT double-check on: SLO %s, steps predicted by %s", slo,
                          self.engine.cost.source if self.engine.cost else "the measured model (none yet)")

    # ---------------------------------------------------------------- jobs and cancels

    async def on_submit(self, job: DecodeJob) -> SubmitAck:
        if job.kv_wait_s > self.config.kv_wait_s:
            job = msgspec.structs.replace(job, kv_wait_s=self.config.kv_wait_s)
        try:
            self.engine.add(job, time.monotonic())
        except KVRejected as exc:
            return SubmitAck.refused(str(exc))
        if job.prefix_source_addr and job.prefix_tokens > 0:  # PrfaaS: the prefix comes from this cluster
            self.prefix_pulls.start(job.request_id, job.prefix_source_addr, job.prefix_block_hashes,
                                    job.prefix_tokens)
        self.sink.registered(job.request_id)
        self.spans.received(job.request_id)
        self.spans.start(job.request_id, "decode.queue", prompt_tokens=job.n_prompt_tokens)
        return SubmitAck.accepted()

    async def on_cancel(self, cancel: Cancel) -> None:
        self.sink.cancelled(cancel.request_id)
        self.outbox.emit([self.engine.abort(cancel.request_id, "abort")])
        self.sink.freed()

    # ---------------------------------------------------------------- what it tells the cluster

    async def report_load(self) -> None:
        await self.reporter.publish_load(self.role, self.load(), self.messenger.addr, self.role_change.draining)

    def load(self) -> Load:
        """queued: requests whose KV is here but that wait for a batch slot (preempted, or beyond
        --max-batch); running: the requests generating (those still waiting for KV are neither)."""
        states = collections.Counter(r.state for r in self.engine.requests.values())
        running = states["running"]
        staging = (self.engine.kv.staging_bytes - self.engine.kv.staging_used) // self.runner.block_bytes
        return Load(states["preempted"] + max(0, running - self.engine.max_batch), 0, running, staging)

    def pace_s(self) -> float:
        """--lend-pace-s, or with a relative TBT SLO (--tbt-slo-s 0) and a measured model, 0.8 of that SLO for the
        longest context running (5x its unloaded step, at least 0.1 s) where that is longer: a model whose step is
        slow here lends its core for as long as its own SLO allows, not for what fits the 0.1 s floor (`kvcentric
        up` sets --lend-pace-s from an absolute SLO itself)."""
        pace, cost = self.config.lend_pace_s, self.engine.cost
        if self.config.tbt_slo_s > 0 or cost is None:
            return pace
        context = max((r.context_tokens for r in self.engine.requests.values() if r.state == "running"), default=0)
        slo = relative_tbt_s(self.config.tbt_slo_factor or TBT_FACTOR, cost.t_decode(1, context + 1))
        return max(pace, PACE_OF_SLO * slo)

    def on_refit(self) -> None:
        """Without --profile, the TBT double-check predicts steps with the decode model measured here (none while
        that is a guess, timed on a busy machine)."""
        if self.prior is not None and not self.config.profile and self.speed.fit.decode.fit is not None:
            guess = "decode" in self.speed.guess
            self.engine.cost = None if guess else self.speed.cost_model(self.prior)

    def idle(self) -> bool:
        """Nothing waiting for KV, generating or still to send (a drain waits for this)."""
        return not self.engine.requests and not self.sink.waiting and self.outbox.empty()

    def gauges(self) -> dict[str, float]:
        running, waiting = self.engine.occupancy()
        kept = dict(self.kept.stats) if self.kept is not None else {}
        return {**self.engine.stats, **self.messenger.stats, **self.reporter.stats(), **self.model.stats(), **kept,
                "kv_staging_bytes_used": self.engine.kv.staging_used, "kv_staging_bytes": self.engine.kv.staging_bytes,
                "requests_running": running, "requests_waiting": waiting}

    def occupancy(self) -> tuple[int, int]:
        return self.engine.occupancy()

    def preemptions(self) -> int:
        return self.engine.stats["preemptions"]

    # ---------------------------------------------------------------- the work loop

    async def work_loop(self) -> None:
        """Decode steps (`DecodeSteps`) in the model thread while any request runs; each step's tokens out, the blocks
        it filled written back, its whole turn (from before scheduling, as the tokens' gaps see it) timed."""
        while not self.stopping.is_set():
            expired = self.engine.expire(time.monotonic())
            for chunk in expired:  # a prefix pull for a request that never got its KV is not needed any more
                self.prefix_pulls.forget(chunk.request_id)
            self.outbox.emit(expired)
            if not self.engine.has_work:
                await self.wake.sleep(0.1)
                continue
            out = self.steps.schedule()
            self.outbox.emit(out.chunks)
            if out.idle:  # everything left is preempted and waiting for blocks
                await self.wake.sleep(0.05)
                continue
            await self.steps.run(out)
            self.outbox.emit(out.chunks)
            if out.error is not None:
                self.log.error("decode step failed", exc_info=out.error)
                continue
            assert out.result is not None
            self.sink.freed()
            self.write_back.send(out.result.filled)
            if self.speed.decode(out.computed.rows, out.computed.kv_tokens, time.perf_counter() - out.started):
                self.on_refit()
            await self.pacer.pace(out.started)

    async def stop(self) -> None:
        await self.write_back.close()
        await super().stop()
