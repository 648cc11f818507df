"""The gateway's asyncio shell: OpenAI-compatible HTTP in, NATS out.

For each completion it validates and tokenizes, hashes the prompt's blocks, asks the conductor for a
placement, hands the job to the decode then the prefill instance, and relays the tokens that come
back on `kvc.req.<id>.out` as one JSON body or as server-sent events. Validation and response shapes
live in `kvcentric.openai_api`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import nats.errors
from aiohttp import web

from kvc_gateway.config import GatewayConfig
from kvcentric.hashing import BlockHasher, to_hex
from kvcentric.model.config import preset
from kvcentric.model.tokenizer import ByteTokenizer
from kvcentric.openai_api import ApiError, check_context, completion_body, parse_completion, usage
from kvcentric.protocol import (BadMessage, Cancel, DecodeJob, InstancesQuery, InstancesReply, Placement,
                                PrefillJob, Rejection, ScheduleReply, ScheduleRequest, SubmitAck, Subjects,
                                TokenChunk, decode, encode)
from kvcentric.service import Service


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


class GatewayService(Service):
    role = "gateway"

    def __init__(self, config: GatewayConfig) -> None:
        super().__init__(config)
        self.config: GatewayConfig = config
        self.model = preset(config.model)
        self.tokenizer = ByteTokenizer()
        self.hasher = BlockHasher(config.hash_algo, config.block_size)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)

    async def instances(self) -> InstancesReply:
        reply = await self.nc.request(Subjects.INSTANCES, encode(InstancesQuery()), timeout=0.5)
        return decode(reply.data, InstancesReply)

    async def _health(self, request: web.Request) -> web.Response:
        try:
            instances = (await self.instances()).instances
        except (nats.errors.Error, asyncio.TimeoutError, BadMessage):
            instances = None
        body = {"status": "ok" if self.ready else "starting", "role": self.role, "model": self.config.model,
                "conductor": instances is not None,
                "prefill_alive": sum(i.role == "prefill" for i in instances or []),
                "decode_alive": sum(i.role == "decode" for i in instances or [])}
        return web.json_response(body, status=200 if self.ready else 503)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.config.model, "object": "model", "created": 0, "owned_by": "kvcentric",
                "max_model_len": self.model.max_position}
        return web.json_response({"object": "list", "data": [card]})

    # ---------------------------------------------------------------- completions

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.counters["requests_total"] += 1
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"the body is not valid JSON: {exc}")
            parsed = parse_completion(body, self.config.model, self.model.vocab_size)
            token_ids = parsed.prompt_token_ids or self.tokenizer.encode(parsed.prompt)
            check_context(len(token_ids), parsed.sampling.max_tokens, self.model.max_position)
        except ApiError as exc:
            self.counters["requests_invalid_total"] += 1
            return error_response(exc)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        subscription = await self.nc.subscribe(Subjects.out(request_id))
        finished = False
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                placement = await self.place(request_id, token_ids, parsed.sampling)
                chunks = self.token_chunks(subscription)
                if parsed.stream:
                    response = await self.stream(request, request_id, parsed, len(token_ids), chunks, placement)
                else:
                    response = await self.collect(request_id, parsed, len(token_ids), chunks, placement)
                finished = True
                return response
        except ApiError as exc:
            finished = exc.status != 504
            self.counters[f"requests_{exc.status}_total"] += 1
            return error_response(exc)
        except TimeoutError:
            self.counters["requests_504_total"] += 1
            return error_response(ApiError(504, f"the request did not finish in {self.config.request_timeout_s} s",
                                           kind="timeout"))
        finally:
            if not finished:
                await self.publish(Subjects.cancel(request_id), Cancel(request_id))
            await subscription.unsubscribe()

    async def ask(self, subject: str, message, kind):
        try:
            reply = await self.nc.request(subject, encode(message), timeout=self.config.bus_timeout_s)
        except nats.errors.NoRespondersError:
            raise ApiError(503, f"nobody answers on {subject}", kind="service_unavailable") from None
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            raise ApiError(503, f"no answer on {subject} in {self.config.bus_timeout_s} s",
                           kind="service_unavailable") from None
        return decode(reply.data, kind)

    async def place(self, request_id: str, token_ids: list[int], sampling) -> Placement:
        """Ask the conductor, then hand the job to decode (which waits for KV) and to prefill."""
        hashes = [to_hex(h) for h in self.hasher.hash_blocks(token_ids)]
        decision = await self.ask(Subjects.SCHEDULE, ScheduleRequest(request_id, len(token_ids), hashes,
                                                                      sampling.max_tokens), ScheduleReply)
        if isinstance(decision, Rejection):
            if decision.reason == "no_instance":
                raise ApiError(503, decision.message, kind="service_unavailable")
            raise ApiError(429, decision.message, kind="rate_limit_exceeded",
                           headers={"Retry-After": str(max(1, round(decision.retry_after_s)))})
        for role, instance, job in (
            ("decode", decision.decode_id, DecodeJob(request_id, len(token_ids), sampling)),
            ("prefill", decision.prefill_id, PrefillJob(request_id, token_ids, sampling, decision.decode_id,
                                                        decision.decode_kv_addr)),
        ):
            ack = await self.ask(Subjects.submit(role, instance), job, SubmitAck)
            if not ack.ok:
                raise ApiError(503, f"{role} instance {instance} refused the request: {ack.error}",
                               kind="service_unavailable")
        return decision

    async def token_chunks(self, subscription):
        """The request's TokenChunks in order, ending with the one that carries finish_reason."""
        async for msg in subscription.messages:
            try:
                chunk = decode(msg.data, TokenChunk)
            except BadMessage as exc:
                self.counters["bus_drops_total"] += 1
                self.log.warning("dropped a token chunk: %s", exc)
                continue
            yield chunk
            if chunk.finish_reason is not None:
                return

    async def collect(self, request_id, parsed, n_prompt, chunks, placement) -> web.Response:
        generated: list[int] = []
        async for chunk in chunks:
            generated += chunk.token_ids
            if chunk.finish_reason == "error":
                raise ApiError(500, chunk.error or "generation failed", kind="server_error")
            if chunk.finish_reason is not None:
                body = completion_body(request_id, parsed.model, self.tokenizer.decode(generated),
                                       chunk.finish_reason, usage(n_prompt, len(generated)))
                return web.json_response(body, headers=self.placement_headers(placement))
        raise ApiError(500, "the token stream ended early", kind="server_error")

    async def stream(self, request, request_id, parsed, n_prompt, chunks, placement) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               **self.placement_headers(placement)})
        await response.prepare(request)
        decoder, created, count = self.tokenizer.stream_decoder(), int(time.time()), 0
        async for chunk in chunks:
            count += len(chunk.token_ids)
            text = decoder.feed(chunk.token_ids)
            if chunk.finish_reason == "error":
                error = ApiError(500, chunk.error or "generation failed", kind="server_error")
                await self.send_event(response, error.body())
                break
            if chunk.finish_reason is not None:
                text += decoder.flush()
            if text or chunk.finish_reason is not None:
                await self.send_event(response, completion_body(request_id, parsed.model, text,
                                                                 chunk.finish_reason, None, created))
        if parsed.include_usage:
            body = completion_body(request_id, parsed.model, "", None, usage(n_prompt, count), created)
            body["choices"] = []
            await self.send_event(response, body)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    async def send_event(response: web.StreamResponse, body: dict) -> None:
        await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")

    @staticmethod
    def placement_headers(placement: Placement) -> dict:
        return {"x-kvcentric-prefill": placement.prefill_id, "x-kvcentric-decode": placement.decode_id}
