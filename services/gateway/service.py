"""The gateway's asyncio shell: OpenAI-compatible HTTP in, NATS out.

For each completion or chat completion it validates and tokenizes, hashes the prompt's blocks, asks the
conductor for a placement (the conductor hands the jobs to the prefill and the decode instance as it
answers, or with --dispatch gateway the gateway does), and relays the tokens that come back on
`kvc.req.<id>.out` (`kvc_gateway.relay`). When a request ends it publishes a RequestOutcome and, unless
the engine finished it, a Cancel. Validation and response shapes live in `kvcentric.core.openai_api`, what a
rejection becomes in `kvcentric.core.errors`; it holds no scheduling policy. Its parts: `intake` (the API key,
the body, the jobs), `placing` (asking the conductor), `relay` and `batch` (the answer), `outcomes` (the end of a
request), `endpoints` (models, tokenize, OpenAPI).
"""

from __future__ import annotations

import contextlib
import ssl
import time
from collections.abc import AsyncIterator

import nats.errors
from aiohttp import web

from kvc_gateway import batch, relay
from kvc_gateway.batch import all_or_none
from kvc_gateway.config import GatewayConfig
from kvc_gateway.endpoints import Endpoints
from kvc_gateway.intake import Intake, api_key_check, client_request_id
from kvc_gateway.migrating import Migrations
from kvc_gateway.outcomes import Outcomes
from kvc_gateway.placing import Placing
from kvc_gateway.textstream import TextStream
from kvcentric.core.migration import MigrationPolicy
from kvcentric.core.metrics import labelled
from kvcentric.core.openai_api import ApiError
from kvcentric.core.protocol import BadMessage, InstancesQuery, InstancesReply, Placement, Subjects, TokenChunk, decode
from kvcentric.model.tokenizer import load_tokenizer
from kvcentric.runtime import tracing
from kvcentric.runtime.http import RETRY_AFTER_S, error_response
from kvcentric.runtime.security import read_api_keys, server_context
from kvcentric.runtime.service import Service


class GatewayService(Service):
    role = "gateway"

    def __init__(self, config: GatewayConfig) -> None:
        super().__init__(config)
        self.config: GatewayConfig = config
        self.model = config.model_config
        self.model_name = config.served_names[0]
        self.tokenizer = load_tokenizer(config.model)
        self.in_flight = 0
        self.running: dict[int, relay.Job] = {}
        """The requests being served, to end their token streams when the bus connection drops."""
        self.bus.on_disconnect.append(self.end_streams)
        self.migrations = Migrations(self.bus, self.metrics, self.running, MigrationPolicy(config.max_migrations),
                                     config.silent_after_s, self.log)
        self.token_texts: dict[int, str] = {}
        self.placing = Placing(config, self.bus, self.counters, self.migrations)
        self.outcomes = Outcomes(self.bus, self.metrics, self.model_name, self.log)
        self.http.limits = config.http_limits
        self.api_keys = ((config.api_key,) if config.api_key else ()) + \
            (read_api_keys(config.api_keys_file) if config.api_keys_file else ())
        """The keys /v1/* takes (none: it is open)."""
        self.http.on_error = self.count_error
        self.intake = Intake(config, self.tokenizer)
        self.endpoints = Endpoints(config, self.tokenizer, bool(self.api_keys))

    def count_error(self, status: int) -> None:
        """An error the HTTP layer answered (no such path, a body too large or too slow, a failure)."""
        self.counters[labelled("requests_total", outcome=str(status))] += 1

    async def start(self) -> None:
        await self.migrations.start(self.tasks.spawn, self.tasks.every)
        await self.placing.start()

    def add_routes(self, app: web.Application) -> None:
        app.middlewares.append(api_key_check(self.api_keys, self.counters))
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.endpoints.add_routes(app)

    def gauges(self) -> dict[str, float]:
        return {"requests_in_flight": self.in_flight}

    def http_tls(self) -> ssl.SSLContext | None:
        if not self.config.https_cert:
            return None
        return server_context(self.config.https_cert, self.config.https_key, "https_cert", "https_key")

    # ---------------------------------------------------------------- health

    async def instances(self) -> InstancesReply:
        return await self.bus.request(Subjects.INSTANCES, InstancesQuery(), InstancesReply, timeout_s=0.5)

    async def health_view(self) -> tuple[int, dict]:
        try:
            instances = (await self.instances()).instances
        except (TimeoutError, nats.errors.Error, BadMessage):
            instances = None
        body = {"status": "ok" if self.ready else "starting", "role": self.role, "model": self.model_name,
                "conductor": instances is not None,
                "prefill_alive": sum(i.role == "prefill" for i in instances or []),
                "decode_alive": sum(i.role == "decode" for i in instances or []),
                "slos_last_placed": self.placing.slos,
                "conductors_heartbeating": sorted(self.placing.conductors.peers(time.monotonic())),
                "schedule_no_responders": self.counters["schedule_no_responders_total"]}
        return (200 if self.ready else 503), body

    async def readiness(self) -> str:
        """Ready when the conductor answers and sees a prefill and a decode instance (so it is ready too)."""
        try:
            instances = (await self.instances()).instances
        except (TimeoutError, nats.errors.Error, BadMessage):
            return "the conductor does not answer"
        missing = [role for role in ("prefill", "decode") if not any(i.role == role for i in instances)]
        return f"the conductor sees no {' and no '.join(missing)} instance" if missing else ""

    # ---------------------------------------------------------------- completions

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.serve(request, chat=True)

    async def serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        started = time.perf_counter()
        with tracing.span("gateway.request", tracing.extract_headers(request.headers), tracing.SpanKind.SERVER,
                          {"http.route": request.path}) as span:
            try:
                jobs = await self.intake.parse(request, chat, started)
            except ApiError as exc:
                self.counters[labelled("requests_total", outcome=str(exc.status))] += 1
                span.set_attribute("http.response.status_code", exc.status)
                return error_response(exc)
            lead = jobs[0]
            span.set_attributes({"kvc.request_id": lead.request_id,
                                 "kvc.prompt_tokens": sum(len(job.token_ids) for job in jobs),
                                 "kvc.prompts": len(jobs), "kvc.max_tokens": lead.request.sampling.max_tokens,
                                 "kvc.stream": lead.request.stream, "enduser.id": lead.request.user or ""})
            self.in_flight += len(jobs)
            outcome = "cancelled"
            try:
                response, outcome = await self.generate(request, jobs)
                span.set_attribute("http.response.status_code", response.status)
                return response
            finally:
                self.in_flight -= len(jobs)
                span.set_attribute("kvc.outcome", outcome)
                for job in jobs:  # a prompt of a batch answered whole keeps its own ending
                    await self.outcomes.finish(job, job.finish_reason if len(jobs) > 1 and job.answered and
                                               job.finish_reason else outcome)

    def new_text(self, job: relay.Job) -> TextStream:
        return TextStream(self.tokenizer.stream_decoder(), job.request.stop)

    async def open_job(self, job: relay.Job) -> AsyncIterator[relay.Piece]:
        """Listen for the job's tokens and place it; its pieces (`relay.pieces`) once placed."""
        job.output = await self.bus.subscribe_raw(Subjects.out(job.bus_id))
        self.running[id(job)] = job
        await self.placing.place(job, job.token_ids, job.request.sampling)
        return relay.pieces(job, self.token_chunks(job), lambda: self.new_text(job), self.outcomes.tbt.observe)

    async def close_job(self, job: relay.Job) -> None:
        self.running.pop(id(job), None)
        if job.output is not None:
            with contextlib.suppress(nats.errors.Error):  # already ended by `end_streams`, or NATS is draining
                await job.output.unsubscribe()

    async def generate(self, request: web.Request, jobs: list[relay.Job]) -> tuple[web.StreamResponse, str]:
        """Place, relay and answer; returns the response and the outcome label of the request."""
        lead = jobs[0]
        shapers = [relay.Shaper(job, self.token_text, self.prompt_text(job) if job.request.echo else "")
                   for job in jobs]
        silence = self.config.request_timeout_s
        try:
            streams = await all_or_none(self.open_job(job) for job in jobs)
            assert lead.placement is not None, "a job is placed once opened"
            headers = self.response_headers(client_request_id(request) or lead.request_id, lead.placement)
            if len(jobs) > 1:
                return await self.answer_batch(request, jobs, streams, batch.headers_of(headers, jobs), shapers)
            if lead.request.stream:
                response = await relay.stream(request, lead, streams[0], self.model_name, headers, shapers[0],
                                              silence, self.config.keepalive_s,
                                              open_now=not lead.placement.decode_tbt_check)
            else:
                response = await relay.collect(lead, streams[0], self.model_name, headers, shapers[0], silence)
            return response, lead.finish_reason or "500"
        except ApiError as exc:
            return error_response(exc), str(exc.status)
        except TimeoutError:
            error = ApiError(504, f"the request made no progress for {silence:g} s (--request-timeout-s): no token "
                                  f"came, nor its first within its predicted time", kind="timeout")
            if lead.response is not None:  # the stream had started: the error goes into it
                await relay.EventWriter(lead, self.model_name, shapers[0]).error(error)
                return lead.response, "504"
            return error_response(error), "504"
        except ConnectionResetError:
            if lead.response is None:  # the client left before its stream opened: nothing to answer with
                raise
            return lead.response, "cancelled"
        finally:
            for job in jobs:
                await self.close_job(job)

    async def answer_batch(self, request: web.Request, jobs: list[relay.Job], streams: list, headers: dict,
                           shapers: list[relay.Shaper]) -> tuple[web.StreamResponse, str]:
        """A batch's answer (`kvc_gateway.batch`); its outcome is its prompts' if they all ended alike."""
        silence = self.config.request_timeout_s
        if jobs[0].request.stream:
            open_now = not any(job.placement is not None and job.placement.decode_tbt_check for job in jobs)
            response = await batch.stream(request, jobs, streams, self.model_name, headers, shapers, silence,
                                          self.config.keepalive_s, open_now)
        else:
            response = await batch.collect(jobs, streams, self.model_name, headers, shapers, silence)
        reasons = {job.finish_reason or "500" for job in jobs}
        return response, reasons.pop() if len(reasons) == 1 else "mixed"

    async def end_streams(self) -> None:
        """The bus connection dropped: what the engines publish until it is back is lost, so every request
        being served ends now with a 503 (`token_chunks`) instead of waiting for tokens that may never come."""
        for job in list(self.running.values()):
            with contextlib.suppress(nats.errors.Error):
                await job.output.unsubscribe()

    def token_text(self, token_id: int) -> str:
        """What stands for a token in a logprobs answer: its text on its own (remembered)."""
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def prompt_text(self, job: relay.Job) -> str:
        return job.request.prompt if job.request.prompt is not None else self.tokenizer.decode(job.token_ids)

    async def token_chunks(self, job: relay.Job):
        """The request's TokenChunks in order (the reader stops once every choice has ended), across its
        migrations: when an instance it waits on goes silent or fails it, it goes on from live instances
        after the tokens already received (`kvc_gateway.migrating`)."""
        while True:
            async for msg in job.output.messages:
                try:
                    chunk = decode(msg.data, TokenChunk)
                except BadMessage as exc:
                    self.counters["bus_drops_total"] += 1
                    self.log.warning("dropped a token chunk: %s", exc)
                    continue
                if job.failure is None and chunk.finish_reason == "error":
                    found = await self.migrations.failure_of(job, chunk)
                    job.failure = job.failure or found  # the watch may have found a silent instance meanwhile
                if job.failure is not None:
                    break
                if chunk.index == 0:
                    job.received += chunk.token_ids
                self.migrations.received(job, len(chunk.token_ids))
                if chunk.token_ids and not job.first_token_told:
                    await self.outcomes.tell_first_token(job)
                yield chunk
            if job.failure is None:
                break
            await self.migrations.migrate(job, self.placing.place)
        raise ApiError(503, "the gateway lost its NATS connection while the request ran (its tokens may be lost); "
                            "retry", kind="service_unavailable", headers={"Retry-After": RETRY_AFTER_S})

    @staticmethod
    def response_headers(request_id: str, placement: Placement) -> dict:
        """Where the request runs, its predicted TTFT, and the SLOs it was admitted under (when the conductor
        knew them)."""
        slos = {f"x-kvcentric-{name}-slo-s": f"{seconds:.6f}" for name, seconds in
                (("ttft", placement.ttft_slo_s), ("tbt", placement.tbt_slo_s)) if seconds > 0}
        return {"x-request-id": request_id, "x-kvcentric-prefill": placement.prefill_id,
                "x-kvcentric-decode": placement.decode_id,
                "x-kvcentric-predicted-ttft-s": f"{placement.predicted_ttft_s:.6f}", **slos}
