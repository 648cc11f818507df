"""One replayed request over HTTP: a streaming /v1/completions, timed as its client sees it (first
token, last token, token count, HTTP status, Retry-After, placement headers); it schedules nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp


@dataclasses.dataclass(slots=True)
class Outcome:
    """What happened to one request; times are seconds on the replay's clock (time.perf_counter())."""

    sent: float = -1.0
    first_token: float = -1.0
    finish: float = -1.0
    status: int = 0
    """HTTP status; 0 when the connection failed."""
    finish_reason: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    error_type: str = ""
    retry_after_s: float = 0.0
    prefill_id: str = ""
    decode_id: str = ""
    predicted_ttft_s: float = 0.0
    """The conductor's prediction, from the x-kvcentric-predicted-ttft-s header."""
    last_chunk: float = -1.0
    gaps: list[float] = dataclasses.field(default_factory=list)
    """Seconds between consecutive chunks of text after the first (a stall shows as one long gap)."""


def completion_body(model: str, token_ids: list[int], max_tokens: int) -> dict:
    """Greedy, exactly max_tokens (ignore_eos), streamed with usage, so lengths follow the trace."""
    return {"model": model, "prompt": token_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def send(session: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None,
               timeout_s: float = 600.0) -> Outcome:
    """POST the body and read its event stream; never raises for HTTP or connection errors."""
    outcome = Outcome(sent=time.perf_counter())
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
                outcome.status = response.status
                outcome.prefill_id = response.headers.get("x-kvcentric-prefill", "")
                outcome.decode_id = response.headers.get("x-kvcentric-decode", "")
                outcome.predicted_ttft_s = float(response.headers.get("x-kvcentric-predicted-ttft-s", 0.0))
                if response.status != 200:
                    await _http_error(outcome, response)
                else:
                    await _read_events(outcome, response)
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        outcome.error = outcome.error or f"{type(exc).__name__}: {exc}"
    if outcome.finish < 0:
        outcome.finish = time.perf_counter()
    return outcome


async def _http_error(outcome: Outcome, response: aiohttp.ClientResponse) -> None:
    text = await response.text()
    try:
        error = json.loads(text)["error"]
        outcome.error, outcome.error_type = error.get("message", ""), error.get("type", "")
    except (ValueError, KeyError, TypeError):
        outcome.error = text[:300]
    retry_after = response.headers.get("Retry-After")
    if retry_after and retry_after.replace(".", "", 1).isdigit():
        outcome.retry_after_s = float(retry_after)


async def _read_events(outcome: Outcome, response: aiohttp.ClientResponse) -> None:
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):].strip()
        if data == b"[DONE]":
            break
        apply_event(outcome, json.loads(data), time.perf_counter())


def apply_event(outcome: Outcome, event: dict, now: float) -> None:
    """Fold one SSE event (a chunk, the usage chunk, or an error) into the outcome."""
    if "error" in event:
        outcome.error = event["error"].get("message", "")
        outcome.error_type = event["error"].get("type", "")
        return
    for choice in event.get("choices") or []:
        if outcome.first_token < 0:
            outcome.first_token = now
        elif choice.get("text"):
            outcome.gaps.append(now - outcome.last_chunk)
        if choice.get("text") or outcome.last_chunk < 0:
            outcome.last_chunk = now
        if choice.get("finish_reason"):
            outcome.finish_reason = choice["finish_reason"]
            outcome.finish = now
    usage = event.get("usage")
    if usage:
        outcome.completion_tokens = usage.get("completion_tokens", 0)
        outcome.prompt_tokens = usage.get("prompt_tokens", 0)
        outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
