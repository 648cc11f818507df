"""Streaming load on a gateway, recorded request by request, and the figures of a fault run drawn from the
records (sent, completed, failed cleanly, hung, seconds to recover); it injects no fault and asserts nothing.

A `Load` runs its clients on an event loop of its own in a thread, so the test's thread is free to inject
faults meanwhile: closed-loop clients (each sends its next request when the last one ended) for steady load,
or open-loop arrivals at a rate (Poisson) for overload. Every request is a streaming completion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from collections.abc import Callable

import aiohttp

CLEAN_STATUSES = {429: "rate_limit_exceeded", 503: "service_unavailable"}
"""The refusals a fault or overload may end a request with, and their OpenAI error types."""
READ_CAP_S = 15.0
"""The client gives up on a request that sent nothing for this long (it counts as hung: every bound is below)."""
PAUSE_AFTER_FAILURE_S = 0.25
"""A closed-loop client's pause after a refusal, so that fast 503s do not turn into a flood of requests."""


@dataclasses.dataclass
class Answer:
    """One request as its client saw it; times are time.monotonic()."""

    started: float
    ended: float = 0.0
    status: int = 0
    """HTTP status; 0 when no HTTP answer came (connection refused or reset, or nothing for READ_CAP_S)."""
    error: dict | None = None
    """The OpenAI error object of a refusal (body or stream event), or {"message": ...} of a transport error."""
    retry_after: str | None = None
    shaped: bool = False
    """A refusal in OpenAI's JSON error shape: {"error": {"message", "type", "param", "code"}}."""
    in_stream: bool = False
    """The error came as an event after a 200 stream had started (no Retry-After header can come then)."""
    done: bool = False
    """The stream ended with `data: [DONE]`."""
    longest_wait_s: float = 0.0
    """The longest time the client waited with nothing arriving (the request's head to its first bytes,
    then between reads), up to its end."""
    tokens: int = 0
    prefill: str | None = None
    decode: str | None = None
    last_read: float = 0.0
    """When something last arrived (the request's start until then)."""

    def __post_init__(self) -> None:
        self.last_read = self.last_read or self.started

    def heard(self) -> None:
        """Something arrived now: the wait since the last arrival counts toward `longest_wait_s`."""
        now = time.monotonic()
        self.longest_wait_s = max(self.longest_wait_s, now - self.last_read)
        self.last_read = now

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None

    @property
    def clean_refusal(self) -> bool:
        """A 429 or 503 with Retry-After in OpenAI's error shape, or the same refusal as an error event of a
        stream that had started (its type says which)."""
        if not self.shaped or self.error is None or self.error.get("type") not in CLEAN_STATUSES.values():
            return False
        if self.in_stream:
            return self.status == 200
        return CLEAN_STATUSES.get(self.status) == self.error["type"] and _seconds(self.retry_after) is not None

    def hung(self, bound_s: float) -> bool:
        return self.longest_wait_s > bound_s or not self.ended

    def brief(self) -> dict:
        """What a failure message shows of this answer."""
        return {"status": self.status, "error": self.error, "retry_after": self.retry_after,
                "waited_s": round(self.longest_wait_s, 2), "took_s": round(self.ended - self.started, 2),
                "decode": self.decode, "prefill": self.prefill}


def _seconds(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and seconds >= 0 else None


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the load's requests look like: prompt lengths (tokens) and output lengths, drawn uniformly."""

    prompt_tokens: tuple[int, int] = (50, 1500)
    max_tokens: tuple[int, int] = (16, 48)
    vocab: tuple[int, int] = (3, 255)

    def body(self, rng: random.Random) -> dict:
        prompt = [rng.randint(*self.vocab) for _ in range(rng.randint(*self.prompt_tokens))]
        return {"prompt": prompt, "max_tokens": rng.randint(*self.max_tokens), "temperature": 0,
                "ignore_eos": True, "stream": True}


class Load:
    """Streaming completions sent to `url` until `stop`: `clients` closed-loop clients, or open-loop arrivals
    at `rate` per second. `answers` holds every request, in flight ones included (ended == 0)."""

    def __init__(self, url: str, clients: int = 4, rate: float = 0.0, shape: Shape = Shape(), seed: int = 0,
                 read_cap_s: float = READ_CAP_S) -> None:
        self.url, self.clients, self.rate, self.shape = url, clients, rate, shape
        self.rng, self.read_cap_s = random.Random(seed), read_cap_s
        self.answers: list[Answer] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    def __enter__(self) -> Load:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self, timeout_s: float = READ_CAP_S + 30) -> list[Answer]:
        """Send no more; wait for the requests in flight to end (each ends within its read cap)."""
        self.stopping.set()
        self.thread.join(timeout_s)
        return self.answers

    def since(self, moment: float) -> list[Answer]:
        return [answer for answer in self.answers if answer.started >= moment]

    def in_flight(self, where: Callable[[Answer], bool] = lambda answer: True) -> list[Answer]:
        return [answer for answer in list(self.answers) if not answer.ended and where(answer)]

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.read_cap_s)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            if self.rate > 0:
                await self._arrivals(session)
            else:
                await asyncio.gather(*(self._client(session) for _ in range(self.clients)))

    async def _client(self, session: aiohttp.ClientSession) -> None:
        while not self.stopping.is_set():
            answer = await self._request(session)
            if not answer.ok:
                await asyncio.sleep(PAUSE_AFTER_FAILURE_S)

    async def _arrivals(self, session: aiohttp.ClientSession) -> None:
        requests: set[asyncio.Task] = set()
        while not self.stopping.is_set():
            task = asyncio.create_task(self._request(session))
            requests.add(task)
            task.add_done_callback(requests.discard)
            await asyncio.sleep(self.rng.expovariate(self.rate))
        await asyncio.gather(*requests)

    async def _request(self, session: aiohttp.ClientSession) -> Answer:
        answer = Answer(started=time.monotonic())
        self.answers.append(answer)
        try:
            async with session.post(self.url + "/v1/completions", json=self.shape.body(self.rng)) as response:
                await _read(answer, response)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            answer.status, answer.error = 0, {"message": f"{type(exc).__name__}: {exc}"}
            answer.heard()
        answer.ended = time.monotonic()
        return answer


async def _read(answer: Answer, response: aiohttp.ClientResponse) -> None:
    """Fill `answer` from a response: a refusal's body, or the stream's events as they arrive."""
    answer.heard()
    answer.status = response.status
    answer.retry_after = response.headers.get("Retry-After")
    answer.prefill = response.headers.get("x-kvcentric-prefill")
    answer.decode = response.headers.get("x-kvcentric-decode")
    if response.status != 200:
        _refusal(answer, await response.read(), response.content_type)
        answer.heard()
        return
    async for line in response.content:
        answer.heard()
        _event(answer, line.strip())


def _refusal(answer: Answer, body: bytes, content_type: str) -> None:
    try:
        parsed = json.loads(body) if content_type == "application/json" else None
    except ValueError:
        parsed = None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    answer.error = error if isinstance(error, dict) else {"message": body[:300].decode(errors="replace")}
    answer.shaped = _shaped(error)


def _shaped(error) -> bool:
    return (isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys()
            and isinstance(error["message"], str) and isinstance(error["type"], str))


def _event(answer: Answer, line: bytes) -> None:
    if not line.startswith(b"data: "):
        return
    data = line[len(b"data: "):]
    if data == b"[DONE]":
        answer.done = True
        return
    event = json.loads(data)
    if "error" in event:
        answer.error, answer.shaped, answer.in_stream = event["error"], _shaped(event["error"]), True
    else:
        answer.tokens += 1


@dataclasses.dataclass
class Figures:
    """One fault run in numbers: every request sent falls in exactly one of completed, failed cleanly, hung
    (waited past the bound with nothing arriving, whatever its end) and failed otherwise."""

    fault: str
    sent: int
    completed: int
    failed_cleanly: int
    hung: int
    failed_otherwise: int
    bound_s: float
    longest_wait_s: float
    recovery_s: float | None
    """Seconds from the fault's end until the first request of an unbroken run of successes to the end of
    the load started (0: none failed after the fault's end; None: the run never came)."""
    in_flight_at_fault: int
    blocks_leaked: int = 0
    """KV blocks not free (and staged KV bytes not released) on the engines once the cluster was idle again."""
    notes: dict = dataclasses.field(default_factory=dict)

    def as_row(self) -> dict:
        return dataclasses.asdict(self)


def figures(fault: str, answers: list[Answer], fault_end: float, bound_s: float, in_flight_at_fault: int,
            ) -> tuple[Figures, dict[str, list[dict]]]:
    """The figures of a run, and the answers behind what went wrong (hung, failed otherwise) for messages."""
    hung = [a for a in answers if a.hung(bound_s)]
    completed = [a for a in answers if a.ok and not a.hung(bound_s)]
    clean = [a for a in answers if a.clean_refusal and not a.hung(bound_s)]
    otherwise = [a for a in answers if not (a.ok or a.clean_refusal or a.hung(bound_s))]
    figured = Figures(fault=fault, sent=len(answers), completed=len(completed), failed_cleanly=len(clean),
                      hung=len(hung), failed_otherwise=len(otherwise), bound_s=bound_s,
                      longest_wait_s=round(max((a.longest_wait_s for a in answers), default=0.0), 2),
                      recovery_s=recovery(answers, fault_end), in_flight_at_fault=in_flight_at_fault)
    return figured, {"hung": [a.brief() for a in hung], "failed otherwise": [a.brief() for a in otherwise]}


def recovery(answers: list[Answer], fault_end: float) -> float | None:
    """Seconds from `fault_end` until the unbroken run of successes that ends the load began (by the
    requests' start times); None if the last request started after the fault's end did not succeed."""
    after = sorted((a for a in answers if a.started >= fault_end), key=lambda a: a.started)
    failed = [i for i, answer in enumerate(after) if not answer.ok]
    if not failed:
        return 0.0
    if failed[-1] == len(after) - 1:
        return None
    return round(after[failed[-1] + 1].started - fault_end, 2)


def refusal_reasons(answers: list[Answer]) -> dict[str, int]:
    """How many refusals of each (status, message) there were: what a table's note says of a run."""
    reasons: dict[str, int] = {}
    for answer in answers:
        if not answer.ok and answer.error is not None:
            key = f"{answer.status} {answer.error.get('message', '')}"[:120]
            reasons[key] = reasons.get(key, 0) + 1
    return dict(sorted(reasons.items(), key=lambda item: -item[1]))
