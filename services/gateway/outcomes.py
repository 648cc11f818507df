"""The end of a gateway request and what is learned from it: the latency histograms (also under vLLM's names),
the Cancel to the engines unless they finished it, and the RequestOutcomes the conductors learn from (the first
token as it comes, the whole request at its end). It answers no client and decides nothing.
"""

from __future__ import annotations

import logging
import time

from kvc_gateway import relay
from kvcentric.core.metrics import SIZE_BUCKETS, TOKEN_GAP_BUCKETS_S, labelled
from kvcentric.core.protocol import Cancel, RequestOutcome, Subjects
from kvcentric.runtime.bus import Bus
from kvcentric.runtime.http import BUS_DOWN, Metrics


class Outcomes:
    """Accounts for each request as it ends, and tells the engines and the conductors."""

    def __init__(self, bus: Bus, metrics: Metrics, model_name: str, log: logging.Logger) -> None:
        self.bus, self.metrics, self.counters, self.log = bus, metrics, metrics.counters, log
        histogram = metrics.histogram
        self.ttft = histogram("ttft_seconds", help="time to first token, request in to first token out")
        self.tbt = histogram("tbt_seconds", TOKEN_GAP_BUCKETS_S, help="time between tokens of one request")
        self.e2e = histogram("e2e_seconds", help="request in to last token out")
        self.ttft_error = histogram("ttft_prediction_error_seconds", help="|actual - conductor-predicted| TTFT")
        self.prompt_tokens = histogram("prompt_tokens", SIZE_BUCKETS, help="prompt length in tokens")
        self.generated = histogram("generation_tokens", SIZE_BUCKETS, help="tokens generated per finished request")
        metrics.vllm_labels = {"model_name": model_name}
        metrics.vllm_histograms.update({  # the same observations under vLLM's names
            "time_to_first_token_seconds": self.ttft, "inter_token_latency_seconds": self.tbt,
            "time_per_output_token_seconds": self.tbt, "e2e_request_latency_seconds": self.e2e,
            "request_prompt_tokens": self.prompt_tokens, "request_generation_tokens": self.generated})

    async def finish(self, job: relay.Job, outcome: str) -> None:
        """Account for the request, cancel it on the engines unless they finished it, tell the conductor.
        With the bus gone (the gateway stopping) the answer already made stands; nothing more is sent."""
        self.counters[labelled("requests_total", outcome=outcome)] += 1
        self.prompt_tokens.observe(len(job.token_ids))
        self.count_for_vllm(job, outcome)
        try:
            await self.cancel_on_engines(job, outcome)
            await self.report_outcome(job, outcome)
        except BUS_DOWN as exc:
            self.counters["outcomes_unsent_total"] += 1
            self.log.warning("request %s ended (%s) but the bus is unavailable: %s", job.request_id, outcome,
                             type(exc).__name__)

    def count_for_vllm(self, job: relay.Job, outcome: str) -> None:
        """vLLM's request counters for a request that reached the engines: its tokens, and how it finished
        (`stop`, `length`, or `abort` for any other ending)."""
        if job.placement is None:
            return
        counters = self.metrics.vllm_counters
        reason = outcome if outcome in ("stop", "length") else "abort"
        counters[labelled("request_success_total", finished_reason=reason)] += 1
        counters["prompt_tokens_total"] += len(job.token_ids)
        counters["generation_tokens_total"] += job.completion_tokens
        if reason != "abort":
            self.generated.observe(job.completion_tokens)

    async def cancel_on_engines(self, job: relay.Job, outcome: str) -> None:
        """Every ending but the engines' own (a final chunk that is not an error) cancels the request where
        it may still be: the client left, a stop string, a timeout, an error chunk from one engine while the
        other still holds its job (a decode that gave up waiting for KV, with the prefill still queued)."""
        if job.engine_finished or (job.placement is None and not job.dispatch_pending):
            return
        self.counters[labelled("cancels_sent_total", outcome=outcome)] += 1
        await self.bus.publish(Subjects.cancel(job.bus_id),
                               Cancel(request_id=job.bus_id, reason=f"gateway: {outcome}"))

    async def tell_first_token(self, job: relay.Job) -> None:
        """The conductors learn how long first tokens take against their predictions (their TTFT correction)
        as soon as each comes, not at the request's end; a request migrated before it has no one prediction."""
        job.first_token_told = True
        if job.placement is None or job.migrations:
            return
        ttft = time.perf_counter() - job.started
        try:
            await self.bus.publish(Subjects.FIRST_TOKEN, RequestOutcome(
                request_id=job.bus_id, prefill_id=job.placement.prefill_id, decode_id=job.placement.decode_id,
                finish_reason="", ttft_s=ttft, e2e_s=ttft, prompt_tokens=len(job.token_ids), completion_tokens=1,
                predicted_ttft_s=job.placement.predicted_ttft_s))
        except BUS_DOWN:
            self.counters["outcomes_unsent_total"] += 1

    async def report_outcome(self, job: relay.Job, outcome: str) -> None:
        """Observe the request's latencies and publish its RequestOutcome (the conductor learns from it)."""
        if job.placement is None:
            return
        e2e = time.perf_counter() - job.started
        ttft = job.ttft_s
        if ttft is not None:
            self.ttft.observe(ttft)
            if job.placement.predicted_ttft_s > 0:
                self.ttft_error.observe(abs(ttft - job.placement.predicted_ttft_s))
        if outcome in ("stop", "length"):
            self.e2e.observe(e2e)
        await self.bus.publish(Subjects.OUTCOME, RequestOutcome(
            request_id=job.bus_id, prefill_id=job.placement.prefill_id, decode_id=job.placement.decode_id,
            finish_reason=job.finish_reason or outcome, ttft_s=-1.0 if ttft is None else ttft, e2e_s=e2e,
            prompt_tokens=len(job.token_ids), completion_tokens=job.completion_tokens,
            predicted_ttft_s=job.placement.predicted_ttft_s))
