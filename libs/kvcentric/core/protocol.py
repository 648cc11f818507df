"""Every message that crosses NATS, defined once; it encodes and validates them and does no I/O.

Messages are msgspec Structs encoded as msgpack maps keyed by field name. They are built by field
name only (keyword-only), or by a named constructor for a recurring shape (`TokenChunk.failed`,
`SubmitAck.refused`, `Rejection.overloaded`). New fields go at the end with a default, so an
older peer still decodes a newer message. `decode` raises `BadMessage` for anything that does not
fit its schema; the bus adapter logs and counts such drops (`kvcentric.runtime.bus`).
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

Role = Literal["prefill", "decode"]


class BadMessage(ValueError):
    """A bus message that does not fit its schema."""


# ---------------------------------------------------------------- subjects


class Subjects:
    """NATS subject names (DESIGN.md, "NATS subjects")."""

    SCHEDULE = "kvc.conductor.schedule"
    OUTCOME = "kvc.conductor.outcome"
    FIRST_TOKEN = "kvc.conductor.first_token"
    """The gateway's RequestOutcome of a request whose first token just went out (finish_reason "", e2e_s =
    ttft_s): the conductors learn their TTFT correction from it without waiting for the request's end."""
    INSTANCES = "kvc.conductor.instances"
    CONDUCTORS = "kvc.conductor.alive"
    LOAD_ALL = "kvc.load.>"
    KV_EVENTS_ALL = "kvc.kv.events.>"
    KVS_QUERY = "kvc.kvs.query"
    KVS_DUMP = "kvc.kvs.dump"
    KV_DIGEST_ALL = "kvc.kv.digest.*"
    KV_RESYNC = "kvc.kv.resync"
    """Broadcast: every engine that announces its blocks publishes its digest now (kvs-meta started, its
    Redis came back)."""
    CANCEL_ALL = "kvc.req.*.cancel"

    @staticmethod
    def schedule_at(conductor_id: str) -> str:
        """One conductor replica's own schedule subject: a retry goes to a replica heard from lately, never
        back through the queue group to the one that went silent."""
        return f"kvc.conductor.schedule.{conductor_id}"

    @staticmethod
    def submit(role: str, instance_id: str) -> str:
        return f"kvc.{role}.{instance_id}.submit"

    @staticmethod
    def load(role: str, instance_id: str) -> str:
        return f"kvc.load.{role}.{instance_id}"

    @staticmethod
    def kv_events(node_id: str) -> str:
        return f"kvc.kv.events.{node_id}"

    @staticmethod
    def kv_digest(node_id: str) -> str:
        return f"kvc.kv.digest.{node_id}"

    @staticmethod
    def kv_snapshot(node_id: str) -> str:
        return f"kvc.kv.snapshot.{node_id}"

    @staticmethod
    def control(instance_id: str) -> str:
        return f"kvc.control.{instance_id}"

    @staticmethod
    def out(request_id: str) -> str:
        return f"kvc.req.{request_id}.out"

    @staticmethod
    def cancel(request_id: str) -> str:
        return f"kvc.req.{request_id}.cancel"


# ---------------------------------------------------------------- sampling


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    top_k: int = 0
    """Sample among the k most likely tokens only (0: no limit)."""
    logprobs: int | None = None
    """Return each generated token's logprob and the `logprobs` likeliest alternatives (None: none)."""
    prompt_logprobs: int | None = None
    """Return the logprob of every prompt token after the first, and that many alternatives (None: none).
    The prompt is then computed whole: a cached prefix has no logits."""
    processed_logprobs: bool = False
    """Logprobs of the distribution sampled from (after bias, penalties and temperature; vLLM's
    `processed_logprobs`) instead of the model's raw one (vLLM's default `raw_logprobs`)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """vLLM's: logits of tokens seen in the prompt or the output are divided by it (multiplied when negative)."""
    min_tokens: int = 0
    """EOS and the stop tokens cannot be sampled before this many tokens."""
    logit_bias: dict[int, float] = {}
    n: int = 1
    """Sequences to sample from the one prompt (parallel sampling: they share its KV blocks)."""
    resumed_tokens: int = 0
    """A migrated request's continuation (`kvcentric.core.migration`): its prompt's last this many tokens
    were generated before the move, and penalties, min_tokens and seeded draws count them as output."""
    guide: str = ""
    """Structured output: an llguidance grammar (`kvcentric.core.structured`) every sequence's tokens must
    follow, applied as a token mask at each sampling step ("": none)."""


# ---------------------------------------------------------------- conductor


class Dispatch(msgspec.Struct, frozen=True, kw_only=True):
    """What the engines need besides the placement, when the conductor is to hand the jobs over itself."""

    token_ids: list[int]
    sampling: SamplingParams


class ScheduleRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    n_tokens: int
    block_hashes: list[str]
    max_tokens: int
    priority: int = 0
    dispatch: Dispatch | None = None
    """Set: the conductor sends the prefill and decode jobs itself as soon as it has placed the request and
    answers without waiting for their acks (a refused job comes back as an error chunk on
    `kvc.req.<id>.out`). None: it only answers, and the asker sends the jobs."""
    avoid: list[str] = []
    """A migrated request's continuation: instances that failed it, not to be placed on again."""


class Placement(msgspec.Struct, frozen=True, tag="placement", kw_only=True):
    request_id: str
    prefill_id: str
    decode_id: str
    decode_kv_addr: str
    """host:port of the decode instance's messenger, where prefill pushes the KV."""
    cached_tokens: int = 0
    predicted_ttft_s: float = 0.0
    predicted_tbt_s: float = 0.0
    kv_source_id: str = ""
    """Hot-spot replication (Mooncake Algorithm 1 line 28): the instance to pull prefix blocks from, or ""."""
    kv_source_addr: str = ""
    """host:port of that instance's messenger."""
    pull_block_hashes: list[str] = []
    """The prefix blocks to pull from kv_source before prefill (they follow the ones held locally)."""
    dispatched: bool = False
    """The conductor sent the jobs itself (the request asked it to). False from a conductor that predates
    dispatching: the asker sends them."""
    decode_prefix_addr: str = ""
    """PrfaaS §3.3: a remote (PrfaaS) prefill ships only the KV after `decode_prefix_tokens`; the decode
    instance takes that prefix from this messenger of its own cluster, or "" (it gets the whole KV pushed)."""
    decode_prefix_hashes: list[str] = []
    """The prefix blocks the decode instance pulls from `decode_prefix_addr` (they cover the prefix tokens)."""
    decode_prefix_tokens: int = 0
    pipeline_addrs: list[str] = []
    """`prefill_id` heads a prefill group: the messengers of its later stages, in order (Mooncake §5.1)."""
    ttft_slo_s: float = 0.0
    """The TTFT SLO the request was admitted under, seconds (absolute, or relative to the unloaded speed); 0: none
    known (no trusted model yet, or a conductor from before SLOs were sent)."""
    tbt_slo_s: float = 0.0
    """The TBT SLO it was admitted under, seconds; 0: none known."""
    decode_tbt_check: bool = True
    """Whether the decode instance double-checks TBT when the KV has arrived (Mooncake §3 step 4), refusing the
    request after its prefill: only where the conductor judged no decode load at placement (`--rejection none`);
    where it did (early, predictive) or admits all (never), nothing computed is refused. True from a conductor from
    before it was sent."""


class Rejection(msgspec.Struct, frozen=True, tag="rejection", kw_only=True):
    request_id: str
    reason: Literal["no_instance", "overloaded", "bad_request"]
    message: str
    retry_after_s: float = 1.0
    stage: str = ""
    """For "overloaded": "prefill" or "decode", the stage whose predicted load was too high."""
    load: float = 0.0
    """That load: predicted TTFT / TTFT_SLO or predicted TBT / TBT_SLO."""

    @classmethod
    def overloaded(cls, request_id: str, message: str, *, retry_after_s: float = 1.0, stage: str = "",
                   load: float = 0.0) -> Rejection:
        return cls(request_id=request_id, reason="overloaded", message=message, retry_after_s=retry_after_s,
                   stage=stage, load=load)

    @classmethod
    def no_instance(cls, request_id: str, message: str) -> Rejection:
        return cls(request_id=request_id, reason="no_instance", message=message, retry_after_s=1.0)

    @classmethod
    def bad_request(cls, request_id: str, message: str) -> Rejection:
        """Asking again will not help: no retry-after."""
        return cls(request_id=request_id, reason="bad_request", message=message, retry_after_s=0.0)


ScheduleReply = Placement | Rejection


class InstanceInfo(msgspec.Struct, frozen=True, kw_only=True):
    instance_id: str
    role: Role
    cluster: str
    kv_addr: str
    load: float
    age_s: float
    busy_s: float = 0.0
    """Seconds since its event loop last computed its load (its heartbeat kept it alive meanwhile)."""


class RequestOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """Published by the gateway on `kvc.conductor.outcome` when a request ends, so the conductor can
    compare its predicted TTFT with the actual one."""

    request_id: str
    prefill_id: str
    decode_id: str
    finish_reason: str
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    completion_tokens: int
    predicted_ttft_s: float = 0.0


class InstancesQuery(msgspec.Struct, frozen=True, kw_only=True):
    role: str = ""
    """Only instances of this role ("" for all)."""


class InstancesReply(msgspec.Struct, frozen=True, kw_only=True):
    instances: list[InstanceInfo]


class ConductorAlive(msgspec.Struct, frozen=True, kw_only=True):
    """A conductor replica's heartbeat on kvc.conductor.alive: the replicas choose who acts alone on
    cluster-wide changes (`kvcentric.core.scheduling.leadership`)."""

    instance_id: str


# ---------------------------------------------------------------- engines


class PrefillJob(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    decode_id: str
    decode_kv_addr: str
    kv_source_addr: str = ""
    """Hot-spot replication: pull `pull_block_hashes` from this messenger before the prefill."""
    pull_block_hashes: list[str] = []
    kv_skip_tokens: int = 0
    """PrfaaS §3.3: the decode instance already has the KV of this many leading tokens (from its own
    cluster); push only the rest."""
    cached_tokens: int = 0
    """Leading prompt tokens the conductor expects this instance to reuse (its queue-time estimate counts the
    rest until the prompt starts and the engine knows)."""
    pipeline_addrs: list[str] = []
    """A prefill group (Mooncake §5.1): the messengers of the stages after this one, in order; this stage
    hands each chunk's hidden states to the first of them."""


class DecodeJob(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    n_prompt_tokens: int
    sampling: SamplingParams
    kv_wait_s: float = 30.0
    """How long the decode instance waits for the request's KV before failing it."""
    prefix_source_addr: str = ""
    """PrfaaS §3.3: pull the KV of the first `prefix_tokens` tokens (blocks `prefix_block_hashes`) from this
    messenger of the local cluster; the prefill pushes only the tokens after them. "": all is pushed."""
    prefix_block_hashes: list[str] = []
    prefix_tokens: int = 0
    tbt_check: bool = True
    """Whether the decode instance double-checks TBT once the KV is here (Placement.decode_tbt_check)."""


class SubmitAck(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    error: str = ""

    @classmethod
    def accepted(cls) -> SubmitAck:
        return cls(ok=True)

    @classmethod
    def refused(cls, error: str) -> SubmitAck:
        return cls(ok=False, error=error)


class MeasuredCost(msgspec.Struct, frozen=True, kw_only=True):
    """An engine's own cost model, fitted online to the prefill chunks and decode steps it timed
    (`kvcentric.core.costfit`); a part it has not measured yet is empty."""

    prefill: list[float] = []
    """(p0, p1, p2, p3) of T_prefill(n_new, n_cached) in seconds, per chunk (`kvcentric.core.costmodel`)."""
    decode: list[float] = []
    """(d0, d1, d2) of T_decode_step(batch, kv_tokens) in seconds."""
    prefill_error: float = -1.0
    """Mean relative error of the prefill fit over the samples it kept (-1: no fit)."""
    decode_error: float = -1.0
    prefill_samples: int = 0
    """Prefill chunks timed since the engine started (calibration included)."""
    decode_samples: int = 0
    last_prefill: list[float] = []
    """The latest prefill chunk timed: (n_new, n_cached, seconds)."""
    last_decode: list[float] = []
    """The latest decode step timed: (batch, kv_tokens, seconds)."""
    prefill_chunk: int = 0
    """Tokens per prefill chunk (a longer prompt costs the sum of its chunks)."""
    kv_bytes_per_token: int = 0
    model: str = ""
    device: str = ""
    dtype: str = ""
    version: int = 0
    """Bumped at every refit."""
    guess: list[str] = []
    """The parts ("prefill", "decode") whose fit rests on samples timed while the machine was busy with other work
    (a calibration beside other processes): a guess, which the conductor ranks by but never rejects on, until the
    engine has measured that part again on a quiet machine, consistently, or while serving."""


class Heartbeat(msgspec.Struct, frozen=True):
    """A `LoadReport` read for its heartbeat tick alone (the gateway's watch of the instances it waits on)."""

    seq: int = 0


class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    """Published by every engine about 10 times a second on `kvc.load.<role>.<id>`."""

    instance_id: str
    role: Role
    cluster: str
    kv_addr: str
    queued_requests: int
    queued_tokens: int
    running: int
    kv_blocks_total: int
    kv_blocks_free: int
    ts: float
    est_queue_s: float = -1.0
    """Prefill: T_queue as the engine predicts it, the sum of its queued and running prefills' predicted
    times from its measured cost model (Mooncake §6.1; -1: none yet, the conductor estimates)."""
    link_bandwidth: dict[str, float] = {}
    """Bytes/s its recent KV pushes reached, per peer messenger address (for the conductor's T_transfer)."""
    kv_bytes_sent: int = 0
    """KV bytes its messenger has pushed since it started (the conductor's measure of PrfaaS egress use)."""
    draining: bool = False
    """It finishes what it has and takes nothing new in this role (a role change is under way)."""
    seq: int = 0
    """The engine's heartbeat tick (from 1; 0: a sender without a heartbeat thread). Reports come from a
    thread that no compute, copy or gRPC stream waits on, so a busy engine keeps sending them."""
    repeat: bool = False
    """The load numbers were sent before: the engine's event loop has computed none since (it is busy);
    this report says the process lives, not what it holds."""
    load_age_s: float = 0.0
    """Seconds since the engine's event loop computed these load numbers."""
    cost: MeasuredCost | None = None
    """Its own measured cost model; sent when refitted and every few reports, absent in the others."""
    kv_staging_blocks_free: int = 0
    """Decode: blocks' worth of KV its host staging can still take while its cache is full (arrivals wait
    there for blocks; the conductor counts them as room)."""
    block_bytes: int = 0
    """Bytes of one KV block over all layers, keys and values (kvs-meta lists it as each object's `size_`,
    as Mooncake's master does); 0: not said."""
    queued_uncached_tokens: int = -1
    """Prefill: tokens still to compute for the prompts queued or running there, their cached prefixes left out
    (Llumnix's allPrefillsTokensNum in uncomputed tokens; -1: not counted, `queued_tokens` is all there is)."""
    prefill_ids: list[str] | None = None
    """Prefill: the requests queued or running there (the newest few hundred), so the conductor knows
    which of its placements `est_queue_s` covers; None: not listed, the report covers every placement."""
    last_prefill: list[float] = []
    """Prefill: the latest prefill chunk it timed, (n_new, n_cached, seconds), in every report (the cost model
    travels only when refitted, every few chunks): how much slower than its model it runs now reaches the
    conductor within a report of the chunk."""
    prefill_samples: int = 0
    """Prefill chunks it has timed so far (`last_prefill` is the one with this number)."""
    pipeline_group: str = ""
    """Prefill: the pipelined prefill group it is a stage of (Mooncake §5.1; "": a whole instance)."""
    stage: int = 0
    """Its stage in that group, from 0."""
    stages: int = 1
    """Stages in that group."""


class RoleSwitch(msgspec.Struct, frozen=True, kw_only=True):
    """On `kvc.control.<id>` (request/reply, answered with a SubmitAck): drain, then serve as `role`.

    PrfaaS §3.4.3 long-term re-planning converts PD instances between prefill and decode."""

    role: Literal["prefill", "decode"]
    reason: str = ""


# ---------------------------------------------------------------- output


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True):
    """One token's log-probability, its rank among all tokens (1: likeliest) and the likeliest tokens."""

    token_id: int
    logprob: float
    rank: int = 1
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class FirstToken(msgspec.Struct, frozen=True, kw_only=True):
    """What a prefill hands its decode instance with the first token when logprobs were asked for (it
    travels msgpack-encoded in the KV commit's `extras`)."""

    logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] = []
    siblings: list[int] = []
    """With n > 1: the first tokens of sequences 1..n-1 (the commit's first_token is sequence 0's)."""
    sibling_logprobs: list[TokenLogprob] = []


class TokenChunk(msgspec.Struct, frozen=True, kw_only=True):
    """Tokens of one request on `kvc.req.<id>.out`; `seq` orders chunks, the last has finish_reason."""

    request_id: str
    seq: int
    token_ids: list[int]
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    error_status: int = 500
    """With finish_reason "error": the HTTP status it means (503 when an instance refused the job)."""
    logprobs: list[TokenLogprob] = []
    """One per token of `token_ids` when the request asked for logprobs."""
    prompt_logprobs: list[TokenLogprob] = []
    """The first chunk, when asked for: prompt tokens 1.. (the first prompt token has none)."""
    index: int = 0
    """Which of the request's n sequences the tokens belong to (the choice index)."""

    @classmethod
    def final(cls, request_id: str, reason: Literal["stop", "length", "abort"], *, seq: int, token_ids: list[int],
              prompt_tokens: int, completion_tokens: int) -> TokenChunk:
        """The last chunk of a request that ended without an error."""
        return cls(request_id=request_id, seq=seq, token_ids=token_ids, finish_reason=reason,
                   prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)

    @classmethod
    def failed(cls, request_id: str, error: str, *, prompt_tokens: int, completion_tokens: int = 0, seq: int = 0,
               status: int = 500) -> TokenChunk:
        """The last chunk of a request that failed: no tokens, finish_reason "error", `status` for HTTP."""
        return cls(request_id=request_id, seq=seq, token_ids=[], finish_reason="error", prompt_tokens=prompt_tokens,
                   completion_tokens=completion_tokens, error=error, error_status=status)


class Cancel(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    reason: str = "client disconnected"


# ---------------------------------------------------------------- kv metadata


class BlockStored(msgspec.Struct, frozen=True, tag="stored", kw_only=True):
    node_id: str
    block_hashes: list[str]
    tier: str = "dram"


class BlockEvicted(msgspec.Struct, frozen=True, tag="evicted", kw_only=True):
    node_id: str
    block_hashes: list[str]
    tier: str = "dram"


KVEvent = BlockStored | BlockEvicted


class KVEventBatch(msgspec.Struct, frozen=True, kw_only=True):
    events: list[KVEvent]


class KVSQuery(msgspec.Struct, frozen=True, kw_only=True):
    block_hashes: list[str]


class KVSReply(msgspec.Struct, frozen=True, kw_only=True):
    holders: list[list[str]]
    """For each queried hash, the holders as "node_id:tier" strings, in query order."""
    error: str = ""
    """Set when kvs-meta could not answer (its Redis is down, the query was bad): holders is empty then."""


class KVSDumpQuery(msgspec.Struct, frozen=True, kw_only=True):
    """One page of kvs-meta's whole block index (a conductor seeding its local mirror)."""

    cursor: int = 0
    """0 for the first page, then the cursor of the previous reply."""
    count: int = 2000
    """About how many blocks the page should hold (kvs-meta may answer fewer, or a few more)."""


class KVSDump(msgspec.Struct, frozen=True, kw_only=True):
    events: list[BlockStored]
    """The page's blocks, one event per holder (node and tier)."""
    cursor: int
    """Where the next page starts; 0 when this was the last page."""


class TierDigest(msgspec.Struct, frozen=True, kw_only=True):
    """A compact summary of a set of block hashes (kvcentric.core.kvdigest): equal sets, equal digests."""

    count: int
    xor: int
    """XOR of each hash's 64-bit BLAKE2b fingerprint."""


class KVDigest(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine holds, in short, per tier ("device", "dram"); sent now and then and on KV_RESYNC on
    kvc.kv.digest.<node_id>. kvs-meta compares it with its index and asks for the full lists on a mismatch."""

    node_id: str
    tiers: dict[str, TierDigest]


class KVResync(msgspec.Struct, frozen=True, kw_only=True):
    reason: str = ""
    full: bool = False
    """Re-announce every held block as BlockStored events on kvc.kv.events.<id> instead of a digest (a
    conductor whose local index could not be seeded from kvs-meta asks for this)."""


class KVSnapshotQuery(msgspec.Struct, frozen=True, kw_only=True):
    """Asks one engine (kvc.kv.snapshot.<node_id>) for every block it holds."""

    tiers: list[str] = []
    """The tiers wanted (empty: all)."""


class KVSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    tiers: dict[str, list[str]]
    """Tier -> every block hash the engine holds there now."""


# ---------------------------------------------------------------- codec

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[object, msgspec.msgpack.Decoder] = {}


MAX_LOGPROBS = 20
"""The most alternatives a token's logprobs may list (OpenAI's bound for top_logprobs)."""
MAX_SEQUENCES = 16
"""The most sequences one request may sample in parallel (n, best_of)."""
_SUBJECT_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")


def job_problem(request_id: str, sampling: SamplingParams) -> str:
    """Why a job from the bus cannot be run as it is (its id is not one NATS subject token, so its tokens
    and cancels could not be addressed; sampling out of range), or ""."""
    if not _SUBJECT_TOKEN.fullmatch(request_id):
        return f"request_id {request_id[:40]!r} must be 1-128 of A-Z a-z 0-9 _ -"
    if sampling.max_tokens < 1:
        return f"max_tokens must be >= 1, got {sampling.max_tokens}"
    if not 0.0 <= sampling.temperature <= 2.0 or not 0.0 < sampling.top_p <= 1.0 or sampling.top_k < 0:
        return (f"sampling out of range: temperature {sampling.temperature} (0..2), top_p {sampling.top_p} "
                f"(0 exclusive..1), top_k {sampling.top_k} (>= 0)")
    counts = [n for n in (sampling.logprobs, sampling.prompt_logprobs) if n is not None]
    if any(not 0 <= n <= MAX_LOGPROBS for n in counts) or sampling.min_tokens < 0:
        return f"logprobs and prompt_logprobs must be in 0..{MAX_LOGPROBS}, min_tokens >= 0"
    if not 1 <= sampling.n <= MAX_SEQUENCES:
        return f"n must be in 1..{MAX_SEQUENCES}, got {sampling.n}"
    if not 0.0 < sampling.repetition_penalty <= 2.0:
        return f"repetition_penalty must be in (0, 2], got {sampling.repetition_penalty}"
    return ""


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, kind):
    """Decode `data` as `kind` (a Struct type or a union of tagged Structs); raise BadMessage."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.msgpack.Decoder(kind)
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadMessage(f"bad {getattr(kind, '__name__', kind)}: {exc}") from exc
