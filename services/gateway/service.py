"""The gateway's asyncio shell: OpenAI-compatible HTTP in, NATS out.

For each completion or chat completion it validates and tokenizes, hashes the prompt's blocks, asks the
conductor for a placement (the conductor hands the jobs to the prefill and the decode instance as it
answers, or with --dispatch gateway the gateway does), and relays the tokens that come back on
`kvc.req.<id>.out` (`kvc_gateway.relay`). When a request ends it publishes a RequestOutcome and, unless
the engine finished it, a Cancel. Validation and response shapes live in `kvcentric.core.openai_api`, what a
rejection becomes in `kvcentric.core.errors`; it holds no scheduling policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import ssl
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import nats.errors
from aiohttp import web

from kvc_gateway import batch, relay
from kvc_gateway.batch import all_or_none
from kvc_gateway.config import GatewayConfig
from kvc_gateway.migrating import Migrations
from kvc_gateway.openapi import openapi_document
from kvc_gateway.textstream import TextStream
from kvcentric.core.dispatch import jobs
from kvcentric.core.errors import rejection_error
from kvcentric.core.hashing import to_hex
from kvcentric.core.migration import MigrationPolicy
from kvcentric.core.metrics import SIZE_BUCKETS, TOKEN_GAP_BUCKETS_S, labelled
from kvcentric.core.openai_api import (ApiError, check_context, parse_chat, parse_completion, parse_detokenize,
                                       parse_tokenize)
from kvcentric.core.protocol import (BadMessage, Cancel, ConductorAlive, Dispatch, InstancesQuery, InstancesReply,
                                     Placement, Rejection, RequestOutcome, SamplingParams, ScheduleReply,
                                     ScheduleRequest, Subjects, TokenChunk, decode, encode)
from kvcentric.core.scheduling.leadership import Leadership
from kvcentric.model.tokenizer import ChatTemplateError, load_tokenizer
from kvcentric.runtime import dispatch, tracing
from kvcentric.runtime.http import BUS_DOWN, RETRY_AFTER_S, error_response
from kvcentric.runtime.security import key_matches, read_api_keys, server_context
from kvcentric.runtime.service import Service

MAX_REQUEST_ID = 256
"""Longest X-Request-ID echoed back; a longer one is replaced by the gateway's own id."""
OPEN_PATHS = ("/health", "/ready", "/metrics", "/openapi.json")
NO_RESPONDERS_PAUSE_S = 0.1
CONDUCTOR_LEASE_S = 1.5
"""A conductor replica not heard from for this long (three of its 0.5 s heartbeats) is not asked again."""
"""Pause before asking again when no conductor is subscribed (one restarting, NATS reconnecting)."""


class SilentConductor(ApiError):
    """The conductor that took a schedule request did not answer in time (it may have died holding it)."""


def client_request_id(request: web.Request) -> str:
    """The client's X-Request-ID, echoed back as it is (printable, at most 256 characters), else ""."""
    value = request.headers.get("X-Request-ID", "")
    return value if len(value) <= MAX_REQUEST_ID and value.isprintable() else ""


class GatewayService(Service):
    role = "gateway"

    def __init__(self, config: GatewayConfig) -> None:
        super().__init__(config)
        self.config: GatewayConfig = config
        self.model = config.model_config
        self.model_name = config.served_names[0]
        self.tokenizer = load_tokenizer(config.model)
        self.hasher = config.hasher()
        self.in_flight = 0
        self.running: dict[int, relay.Job] = {}
        """The requests being served, to end their token streams when the bus connection drops."""
        self.bus.on_disconnect.append(self.end_streams)
        self.migrations = Migrations(self.bus, self.metrics, self.running, MigrationPolicy(config.max_migrations),
                                     config.silent_after_s, self.log)
        self.token_texts: dict[int, str] = {}
        self.slos: dict[str, float] = {}
        """The SLOs the latest placement was admitted under (the conductor's, absolute or relative), for /health."""
        self.conductors = Leadership(f"gateway-{uuid.uuid4().hex[:8]}", time.monotonic(), CONDUCTOR_LEASE_S)
        """The conductor replicas heard from lately: a retry after a silent one goes straight to one of them."""
        histogram = self.metrics.histogram
        self.ttft = histogram("ttft_seconds", help="time to first token, request in to first token out")
        self.tbt = histogram("tbt_seconds", TOKEN_GAP_BUCKETS_S, help="time between tokens of one request")
        self.e2e = histogram("e2e_seconds", help="request in to last token out")
        self.ttft_error = histogram("ttft_prediction_error_seconds", help="|actual - conductor-predicted| TTFT")
        self.prompt_tokens = histogram("prompt_tokens", SIZE_BUCKETS, help="prompt length in tokens")
        self.generated = histogram("generation_tokens", SIZE_BUCKETS, help="tokens generated per finished request")
        self.metrics.vllm_labels = {"model_name": self.model_name}
        self.metrics.vllm_histograms.update({  # the same observations under vLLM's names
            "time_to_first_token_seconds": self.ttft, "inter_token_latency_seconds": self.tbt,
            "time_per_output_token_seconds": self.tbt, "e2e_request_latency_seconds": self.e2e,
            "request_prompt_tokens": self.prompt_tokens, "request_generation_tokens": self.generated})
        self.http.limits = config.http_limits
        self.api_keys = ((config.api_key,) if config.api_key else ()) + \
            (read_api_keys(config.api_keys_file) if config.api_keys_file else ())
        """The keys /v1/* takes (none: it is open)."""
        self.http.on_error = self.count_error

    def count_error(self, status: int) -> None:
        """An error the HTTP layer answered (no such path, a body too large or too slow, a failure)."""
        self.counters[labelled("requests_total", outcome=str(status))] += 1

    async def start(self) -> None:
        await self.migrations.start(self.tasks.spawn, self.tasks.every)
        await self.bus.subscribe(Subjects.CONDUCTORS, ConductorAlive, self.on_conductor)

    async def on_conductor(self, alive: ConductorAlive) -> None:
        self.conductors.heard(alive.instance_id, time.monotonic())

    def schedule_subject(self) -> str:
        """Where to ask: a conductor replica that heartbeats still, chosen at random (the queue group would
        also hand requests to a stopped one, which NATS keeps subscribed until its pings fail); the queue
        group itself while none has been heard (a gateway just started)."""
        live = self.conductors.peers(time.monotonic())
        return Subjects.schedule_at(random.choice(live)) if live else Subjects.SCHEDULE

    def add_routes(self, app: web.Application) -> None:
        app.middlewares.append(self.check_api_key)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id}", self.model_card)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    def gauges(self) -> dict[str, float]:
        return {"requests_in_flight": self.in_flight}

    def http_tls(self) -> ssl.SSLContext | None:
        if not self.config.https_cert:
            return None
        return server_context(self.config.https_cert, self.config.https_key, "https_cert", "https_key")

    @web.middleware
    async def check_api_key(self, request: web.Request, handler):
        """With --api-key or --api-keys-file, everything but health, metrics and the API description needs a key."""
        if self.api_keys and request.path not in OPEN_PATHS:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not key_matches(token.strip(), self.api_keys):
                self.counters[labelled("requests_total", outcome="401")] += 1
                return error_response(ApiError(401, "Incorrect or missing API key: send the header "
                                                    "'Authorization: Bearer <key>' (a key of the gateway's "
                                                    "--api-key or --api-keys-file).",
                                               code="invalid_api_key",
                                               headers={"WWW-Authenticate": "Bearer"}))
        return await handler(request)

    # ---------------------------------------------------------------- small endpoints

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
                "slos_last_placed": self.slos}
        return (200 if self.ready else 503), body

    async def readiness(self) -> str:
        """Ready when the conductor answers and sees a prefill and a decode instance (so it is ready too)."""
        try:
            instances = (await self.instances()).instances
        except (TimeoutError, nats.errors.Error, BadMessage):
            return "the conductor does not answer"
        missing = [role for role in ("prefill", "decode") if not any(i.role == role for i in instances)]
        return f"the conductor sees no {' and no '.join(missing)} instance" if missing else ""

    def card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvcentric",
                "max_model_len": self.model.max_position, "vocab_size": self.model.vocab_size}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self.card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: the served model's card under any of its served names, else a 404."""
        model_id = request.match_info["model_id"]
        if model_id not in self.config.served_names:
            return error_response(ApiError(404, f"the model '{model_id}' does not exist; this server serves "
                                                f"{', '.join(self.config.served_names)}", param="model",
                                           kind="not_found_error", code="model_not_found"))
        return web.json_response(self.card())

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(self.config.served_names, self.model.max_position,
                                                  self.model.vocab_size, bool(self.api_keys)))

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /tokenize: the ids a prompt (or messages, rendered as a chat request is) becomes."""
        asked = parse_tokenize(await self.request_body(request), self.config.served_names)
        try:
            if asked.messages is not None:
                tokens = self.tokenizer.encode_chat(asked.messages, asked.add_generation_prompt, asked.tools)
            else:
                tokens = self.tokenizer.encode(asked.prompt or "", add_bos=asked.add_special_tokens)
        except UnicodeEncodeError:
            raise ApiError(400, "the text is not valid Unicode (it holds a lone surrogate escape)") from None
        except ChatTemplateError as exc:
            raise ApiError(400, f"the model's chat template refused the messages: {exc}", "messages") from None
        strs = [self.tokenizer.token_str(token) for token in tokens] if asked.return_token_strs else None
        return web.json_response({"count": len(tokens), "max_model_len": self.model.max_position,
                                  "tokens": tokens, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /detokenize: the text of token ids."""
        tokens = parse_detokenize(await self.request_body(request), self.config.served_names, self.model.vocab_size)
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

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
                jobs = await self.parse(request, chat, started)
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
                    await self.finish(job, job.finish_reason if len(jobs) > 1 and job.answered and
                                      job.finish_reason else outcome)

    async def request_body(self, request: web.Request):
        """The request's JSON body; a 400 for what is not JSON."""
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        except LookupError:
            raise ApiError(400, f"unknown charset {request.charset!r} in Content-Type: send UTF-8 JSON") from None
        except RecursionError:
            raise ApiError(400, "the JSON body is nested too deeply") from None

    async def parse(self, request: web.Request, chat: bool, started: float) -> list[relay.Job]:
        body = await self.request_body(request)
        try:
            return self.jobs_of(body, chat, started)
        except UnicodeEncodeError:
            raise ApiError(400, "the text is not valid Unicode (it holds a lone surrogate escape)") from None
        except ChatTemplateError as exc:
            raise ApiError(400, f"the model's chat template refused the messages: {exc}", "messages") from None

    def jobs_of(self, body, chat: bool, started: float) -> list[relay.Job]:
        """The validated, tokenized request: one job, or one per prompt of a batch (sharing its id)."""
        context = self.model.max_position
        if chat:
            parsed = parse_chat(body, self.config.served_names, context, self.model.vocab_size)
            shown = parsed.tools.shown if parsed.tools is not None else None
            token_ids = self.tokenizer.encode_chat(parsed.messages, tools=shown)
            if parsed.max_tokens_defaulted:
                sampling = msgspec.structs.replace(parsed.sampling, max_tokens=max(1, context - len(token_ids)))
                parsed = dataclasses.replace(parsed, sampling=sampling)
            check_context(len(token_ids), parsed.sampling.max_tokens, context)
            return [relay.Job(f"chatcmpl-{uuid.uuid4().hex}", parsed, token_ids, chat, started)]
        parsed = parse_completion(body, self.config.served_names, self.model.vocab_size)
        request_id, prompts = f"cmpl-{uuid.uuid4().hex}", parsed.each_prompt()
        jobs = []
        for index, one in enumerate(prompts):
            token_ids = one.prompt_token_ids or self.tokenizer.encode(one.prompt)
            check_context(len(token_ids), one.sampling.max_tokens, context)
            jobs.append(relay.Job(request_id, one, token_ids, chat, started,
                                  batch_index=index if len(prompts) > 1 else None))
        return jobs

    def new_text(self, job: relay.Job) -> TextStream:
        return TextStream(self.tokenizer.stream_decoder(), job.request.stop)

    async def open_job(self, job: relay.Job) -> AsyncIterator[relay.Piece]:
        """Listen for the job's tokens and place it; its pieces (`relay.pieces`) once placed."""
        job.output = await self.bus.subscribe_raw(Subjects.out(job.bus_id))
        self.running[id(job)] = job
        await self.place(job, job.token_ids, job.request.sampling)
        return relay.pieces(job, self.token_chunks(job), lambda: self.new_text(job), self.tbt.observe)

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

    async def ask(self, message, kind):
        """One request/reply to a conductor; while nobody answers it asks again (another replica, or the
        same once it is back) for up to --bus-timeout-s: nothing was delivered, so asking again is safe."""
        patience = time.monotonic() + self.config.bus_timeout_s
        while True:
            subject = self.schedule_subject()
            try:
                return await self.bus.request(subject, message, kind, timeout_s=self.config.bus_timeout_s)
            except nats.errors.NoRespondersError:
                if subject != Subjects.SCHEDULE:  # that replica is gone although its last heartbeat is recent
                    self.conductors.forget(subject.rpartition(".")[2])
                if time.monotonic() < patience:
                    await asyncio.sleep(NO_RESPONDERS_PAUSE_S)
                    continue
                raise ApiError(503, f"nobody answers on {subject}", kind="service_unavailable",
                               headers={"Retry-After": RETRY_AFTER_S}) from None
            except (TimeoutError, nats.errors.TimeoutError):
                raise SilentConductor(503, f"no answer on {subject} in {self.config.bus_timeout_s} s "
                                           f"(--bus-timeout-s)", kind="service_unavailable",
                                      headers={"Retry-After": RETRY_AFTER_S}) from None
            except BadMessage as exc:
                raise ApiError(500, f"a bad answer on {subject}: {exc}", kind="server_error") from None
            except nats.errors.MaxPayloadError:
                raise self.too_large() from None
            except BUS_DOWN as exc:
                raise ApiError(503, f"the bus is unavailable ({type(exc).__name__}); retry shortly",
                               kind="service_unavailable", headers={"Retry-After": RETRY_AFTER_S}) from None

    def too_large(self) -> ApiError:
        return ApiError(400, f"the prompt is too large for the bus (NATS max_payload {self.bus.max_payload} bytes): "
                             f"shorten it or raise the server's max_payload", code="request_too_large")

    async def place(self, job: relay.Job, token_ids: list[int], sampling: SamplingParams) -> Placement:
        """Ask the conductor to place `token_ids` (the prompt, or a migrated request's continuation). With
        --dispatch conductor it hands the jobs to the engines as it answers; with --dispatch gateway they
        are sent from here, to prefill and decode at once."""
        ask = self.schedule_request(job, token_ids, sampling)
        job.dispatch_pending = ask.dispatch is not None
        try:
            decision = await self.ask(ask, ScheduleReply)
        except SilentConductor:
            decision = await self.ask(await self.renew(job, ask), ScheduleReply)
        job.dispatch_pending = False
        if isinstance(decision, Rejection):
            self.counters[labelled("rejections_total", reason=decision.reason)] += 1
            raise rejection_error(decision)
        job.placement = decision
        job.progress_at = time.perf_counter() + max(0.0, decision.predicted_ttft_s)
        if decision.ttft_slo_s > 0 or decision.tbt_slo_s > 0:
            self.slos = {"ttft_s": decision.ttft_slo_s, "tbt_s": decision.tbt_slo_s}
        if job.cached_tokens is None:
            job.cached_tokens = decision.cached_tokens
        self.migrations.placed(job)
        if not decision.dispatched:  # asked not to, or a conductor from before dispatching
            await self.send_jobs(job, decision, token_ids, sampling)
        return decision

    async def renew(self, job: relay.Job, ask: ScheduleRequest) -> ScheduleRequest:
        """After a conductor went silent holding `ask` (another replica of the queue group answers next): cancel
        it on any engine it was handed to, and ask again under a new request id, whose output is listened to
        from now on, so a late job of the old id can neither run nor mix into this stream."""
        await self.bus.publish(Subjects.cancel(job.bus_id),
                               Cancel(request_id=job.bus_id, reason="gateway: its conductor went silent"))
        with contextlib.suppress(nats.errors.Error):  # already ended by `end_streams` when the bus dropped
            await job.output.unsubscribe()
        self.counters["schedule_retries_total"] += 1
        job.bus_id = f"{job.bus_id.partition('-')[0]}-{uuid.uuid4().hex}"
        if job.placement is None and job.batch_index is None:  # its first placement: the client hears the new id
            job.request_id = job.bus_id
        job.output = await self.bus.subscribe_raw(Subjects.out(job.bus_id))
        return msgspec.structs.replace(ask, request_id=job.bus_id)

    def schedule_request(self, job: relay.Job, token_ids: list[int], sampling: SamplingParams) -> ScheduleRequest:
        """What the conductor is asked; with --dispatch conductor it carries the jobs' tokens too, unless
        that would not fit in one NATS message (then they go straight to prefill from here)."""
        unfull = self.config.kvs_enable_save_unfull_chunk
        hashes = [to_hex(h) for h in self.hasher.prefix_keys(token_ids, unfull)]
        ask = ScheduleRequest(request_id=job.bus_id, n_tokens=len(token_ids), block_hashes=hashes,
                              max_tokens=sampling.max_tokens, priority=-job.request.priority, avoid=job.avoid)
        if self.config.dispatch != "conductor":
            return ask
        with_jobs = msgspec.structs.replace(ask, dispatch=Dispatch(token_ids=token_ids, sampling=sampling))
        if len(encode(with_jobs)) <= self.bus.max_payload:
            return with_jobs
        self.counters["dispatch_too_large_total"] += 1
        return ask

    async def send_jobs(self, job: relay.Job, placement: Placement, token_ids: list[int],
                        sampling: SamplingParams) -> None:
        """Hand the jobs to the placed engines; 503 when one did not take its job."""
        try:
            why = await dispatch.submit(self.bus, jobs(job.bus_id, placement, token_ids, sampling),
                                        self.config.bus_timeout_s)
        except nats.errors.MaxPayloadError:
            raise self.too_large() from None
        if why:
            raise ApiError(503, why, kind="service_unavailable", headers={"Retry-After": RETRY_AFTER_S})

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
                    await self.tell_first_token(job)
                yield chunk
            if job.failure is None:
                break
            await self.migrations.migrate(job, self.place)
        raise ApiError(503, "the gateway lost its NATS connection while the request ran (its tokens may be lost); "
                            "retry", kind="service_unavailable", headers={"Retry-After": RETRY_AFTER_S})

    # ---------------------------------------------------------------- the end of a request

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

    @staticmethod
    def response_headers(request_id: str, placement: Placement) -> dict:
        """Where the request runs, its predicted TTFT, and the SLOs it was admitted under (when the conductor
        knew them)."""
        slos = {f"x-kvcentric-{name}-slo-s": f"{seconds:.6f}" for name, seconds in
                (("ttft", placement.ttft_slo_s), ("tbt", placement.tbt_slo_s)) if seconds > 0}
        return {"x-request-id": request_id, "x-kvcentric-prefill": placement.prefill_id,
                "x-kvcentric-decode": placement.decode_id,
                "x-kvcentric-predicted-ttft-s": f"{placement.predicted_ttft_s:.6f}", **slos}
