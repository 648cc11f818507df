"""The decode service's asyncio shell: registers jobs from NATS, receives their KV through the
in-process messenger's gRPC server, runs decode steps in the model thread, and streams tokens on
`kvc.req.<id>.out`. It never computes a prompt: a request starts only once all its layers arrived, and
with --tbt-slo-s only if the batch is predicted to keep its TBT SLO with it (else it is rejected with 429).
"""

from __future__ import annotations

import collections
import time

from kvcentric.engine.decode import DecodeEngine, KVRejected
from kvcentric.engine.config import EngineConfig
from kvcentric.engine.shell import DecodeSink, EngineService
from kvcentric.core.metrics import labelled
from kvcentric.core.protocol import Cancel, DecodeJob, LoadReport, SubmitAck

TBT_REJECTIONS = labelled("rejections_total", reason="tbt")


class CheckedDecodeSink(DecodeSink):
    """The decode sink with Mooncake's double-check: once every layer of a request is here, it joins the
    batch only if the predicted step time with it stays within --tbt-slo-s; otherwise it is rejected after
    prefill (blocks freed at once, a 429 error as its final chunk)."""

    def commit(self, request_id: str, commit) -> None:
        verdict = self.engine.check_tbt(request_id)
        if verdict.accepted:
            super().commit(request_id, commit)
            return
        self.service.counters[TBT_REJECTIONS] += 1
        self.service.log.debug("request %s: %s", request_id, verdict.reason)
        self.service.emit([self.engine.reject_kv(request_id, verdict)])


class DecodeService(EngineService):
    role = "decode"

    def __init__(self, config: EngineConfig, runner=None) -> None:
        super().__init__(config, runner)
        cost = config.cost_model() if config.tbt_slo_s > 0 else None
        self.engine = DecodeEngine(self.runner, self.pool, config.max_batch, cost, config.tbt_slo_s)

    def kv_sink(self):
        self.sink = CheckedDecodeSink(self, self.engine)
        return self.sink

    async def start(self) -> None:
        await super().start()
        await self.subscribe_jobs(self.role, DecodeJob, self.on_submit)
        if self.engine.cost is not None:
            self.log.info("TBT double-check on: SLO %g s, steps predicted by %s", self.engine.tbt_slo_s,
                          self.engine.cost.source)

    async def on_submit(self, job: DecodeJob) -> SubmitAck:
        try:
            self.engine.add(job, time.monotonic())
        except KVRejected as exc:
            return SubmitAck.refused(str(exc))
        self.sink.registered(job.request_id)
        self.spans.received(job.request_id)
        self.spans.start(job.request_id, "decode.queue", prompt_tokens=job.n_prompt_tokens)
        return SubmitAck.accepted()

    async def on_cancel(self, cancel: Cancel) -> None:
        self.sink.cancelled(cancel.request_id)
        self.emit([self.engine.abort(cancel.request_id, "abort")])

    def load_report(self) -> LoadReport:
        """queued: requests whose KV is here but that wait for a batch slot (preempted, or beyond
        --max-batch); running: the requests generating (those still waiting for KV are neither)."""
        states = collections.Counter(r.state for r in self.engine.requests.values())
        running = states["running"]
        return self.base_load(states["preempted"] + max(0, running - self.engine.max_batch), 0, running)

    def idle(self) -> bool:
        return not self.engine.requests and not self.sink.waiting

    async def work_loop(self) -> None:
        while not self.stopping.is_set():
            self.emit(self.engine.expire(time.monotonic()))
            if not self.engine.has_work:
                await self.wait_for_work(0.1)
                continue
            batch, failed = self.engine.schedule()
            self.emit(failed)
            if not batch:  # everything left is preempted and waiting for blocks
                await self.wait_for_work(0.05)
                continue
            try:
                tokens = await self.run_model(self.engine.execute, batch)
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
                self.log.exception("decode step failed")
                self.emit(self.engine.fail_step(batch, f"decode step failed: {exc}"))
                continue
            self.emit(self.engine.update(batch, tokens))
