"""The decode role: requests wait for their KV, then join a continuous batch that generates tokens.

A request's lifecycle: `add` (job known, no blocks) -> `begin_kv` (blocks for the prompt) -> `write_kv`
per layer and token range -> `commit_kv` (every layer complete: first token out, joins the batch) ->
`schedule`/`execute`/`update` each step until it stops. Requests join and leave the batch every step.
Before `commit_kv` the shell may ask `check_tbt` whether the batch keeps its TBT SLO with the request
(Mooncake §3 step 4) and, if not, `reject_kv` it: its blocks are freed and its prefill is wasted.
When blocks run out the newest running request is preempted (blocks freed) and later recomputed from its
tokens, as vLLM does, instead of failing. KV that arrives when no blocks are free waits in a bounded host
staging area and is loaded into blocks once they free up, like a preempted request (Mooncake §3: KV lands
in the decode node's DRAM first); only when staging is full too is it refused, with `KVNoRoom` (a 429 to
the client, retryable). `abort` frees at any point; before that, for a push that broke off, `received_blocks` says
which blocks hold KV in every layer (the sink keeps them findable, `engine/service/keptkv.py`). Time is passed in;
no I/O. Only `execute` touches torch (through the runner) and may run in a worker thread.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Sequence
from typing import Literal

from kvcentric.core.costmodel import CostModel, TBTVerdict, decode_tbt_check
from kvcentric.core.block_pool import BlockPool
from kvcentric.core.kept_kv import ReceivedKV
from kvcentric.core.kv_cache import KVCacheManager
from kvcentric.core.scheduling.slo import relative_tbt_s
from kvcentric.engine.cores.decode_sampling import BatchSampler, cpu_masks
from kvcentric.engine.cores.decode_staging import HostStaging
from kvcentric.engine.cores.sequence import DecodeRequest
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.engine.model.guided import Guides
from kvcentric.core.stopping import finish_reason
from kvcentric.core.protocol import DecodeJob, FirstToken, TokenChunk, TokenLogprob, decode


class KVRejected(RuntimeError):
    """KV offered for a request this engine cannot take (unknown, duplicate, no room, bad shape)."""


NO_ROOM = "decode instance full"
"""Opens the message of every `KVNoRoom`: what a prefill finds in a refused push's error to answer 429."""


class KVNoRoom(KVRejected):
    """KV refused for want of room, neither device blocks nor host staging: overload, the client may retry."""


class DecodeEngine:
    def __init__(self, runner: ModelRunner, pool: BlockPool, max_batch: int = 64, cost: CostModel | None = None,
                 tbt_slo_s: float = 0.0, staging_bytes: int = 0, tbt_slo_factor: float = 0.0,
                 kv: KVCacheManager | None = None) -> None:
        """`cost` predicts a decode step for `check_tbt` against `tbt_slo_s`, or where that is 0 against
        `tbt_slo_factor` x the request's unloaded step (0 too: no check); `staging_bytes` bounds the host memory
        that KV arriving at a full cache may wait in (0: none, refused at once); `kv`: the cache manager over
        `pool` when another role of the instance shares it (colocated)."""
        if tbt_slo_s > 0 and cost is None:
            raise ValueError("a TBT SLO needs a cost model to predict decode steps with")
        self.runner, self.pool, self.max_batch = runner, pool, max_batch
        self.kv = kv if kv is not None else KVCacheManager(pool, staging_bytes)
        """Every block this engine takes, shares and frees, and its host staging, go through it."""
        self.cost, self.tbt_slo_s, self.tbt_slo_factor = cost, tbt_slo_s, tbt_slo_factor
        self.requests: dict[str, DecodeRequest] = {}
        self.guides = Guides(runner.config, overlap=runner.device.type != "cpu")
        """Structured output's grammar state of each guided sequence (masks computed during the forward pass where
        it leaves the CPU free)."""
        self.sampler = BatchSampler(self.guides, runner.config.eos_token_ids, cpu_masks(runner))
        self.staging = HostStaging(runner, self.kv)
        """Where KV that arrives at a full cache waits for blocks."""
        self.preempted: collections.deque[str] = collections.deque()
        self._in_step: set[str] = set()
        self.stats = {"kv_staged": 0, "kv_refused_no_room": 0, "kv_bytes_received": 0, "kv_streams_committed": 0,
                      "prefill_tokens_computed": 0,
                      "recomputed_tokens": 0, "preemptions": 0, "decode_steps": 0, "batch_size_sum": 0,
                      "tokens_generated": 0, "requests_finished": 0, "requests_aborted": 0,
                      "requests_rejected_tbt": 0, "sequences_forked": 0}

    # ---------------------------------------------------------------- admission and KV arrival

    def add(self, job: DecodeJob, now: float) -> None:
        if job.request_id in self.requests:
            raise KVRejected(f"request {job.request_id} is already here")
        self.requests[job.request_id] = DecodeRequest(job, deadline=now + job.kv_wait_s)

    def begin_kv(self, request_id: str, num_tokens: int, num_layers: int, prompt: Sequence[int] = (),
                 join: bool = False, pool_addr: str = "") -> None:
        """Allocate blocks for a request's prompt KV; `join`: another stripe of a transfer already begun;
        `pool_addr`: where the blocks its generated tokens fill may go (`engine/service/writeback.py`)."""
        if join and request_id in self.requests and self.requests[request_id].state == "receiving":
            return
        request = expect(self.requests, request_id, "waiting_kv")
        if num_tokens != request.job.n_prompt_tokens or num_layers != self.runner.config.num_layers:
            raise KVRejected(f"request {request_id}: KV for {num_tokens} tokens x {num_layers} layers, "
                             f"expected {request.job.n_prompt_tokens} x {self.runner.config.num_layers}")
        needed = self.kv.blocks_for(num_tokens + 1)
        if self.kv.can_allocate(needed) and not (self.preempted and self.staging.fits(request)):
            request.blocks = self.kv.allocate(needed)  # (with requests waiting for blocks, it queues behind)
        else:
            self._stage(request, needed)
        request.prompt = list(prompt)
        request.layer_tokens = [0] * num_layers
        request.received = ReceivedKV(num_layers)
        request.state = "receiving"
        request.pool_addr = pool_addr

    def _stage(self, request: DecodeRequest, needed: int) -> None:
        """No blocks for the request now (or older requests wait for them): its KV waits in host memory,
        if staging has room for it, else it is refused."""
        if not self.staging.fits(request):
            self.stats["kv_refused_no_room"] += 1
            raise KVNoRoom(f"{NO_ROOM}: request {request.request_id} needs {needed} KV blocks "
                           f"({self.kv.num_free} free) and host staging is full "
                           f"({self.kv.staging_used} of {self.kv.staging_bytes} bytes used)")
        self.staging.stage(request)
        self.stats["kv_staged"] += 1

    def write_kv(self, request_id: str, layer: int, start: int, end: int, key: bytes, value: bytes) -> None:
        request = expect(self.requests, request_id, "receiving")
        if not (0 <= layer < self.runner.config.num_layers and 0 <= start < end <= request.job.n_prompt_tokens):
            raise KVRejected(f"request {request_id}: layer {layer} tokens {start}..{end} out of range")
        if request.staged is not None:  # the sender's bytes may be views of its memory: keep a copy
            expected = (end - start) * self.runner.layer_token_bytes
            if len(key) != expected or len(value) != expected:
                raise KVRejected(f"request {request_id}: layer {layer}: expected {expected} bytes each for key "
                                 f"and value, got {len(key)} and {len(value)}")
            request.staged.append((layer, start, end, bytes(key), bytes(value)))
        else:
            self.runner.write_layer(layer, request.blocks, start, end, key, value)
        request.layer_tokens[layer] += end - start
        if request.received is not None:
            request.received.add(layer, start, end)
        self.stats["kv_bytes_received"] += len(key) + len(value)

    def check_tbt(self, request_id: str) -> TBTVerdict:
        """All layers are in: would a decode step keep within the TBT SLO with this request in the batch?
        The batch counted is every request with its KV here (running or preempted), whatever --max-batch."""
        request = received(self.requests, request_id)
        if not request.job.tbt_check:  # the conductor judged its decode load at placement: nothing computed is refused
            return TBTVerdict(True, 0.0, 0.0)
        relative = (relative_tbt_s(self.tbt_slo_factor, self.cost.t_decode(1, request.context_tokens))
                    if self.cost is not None and self.tbt_slo_factor > 0 else 0.0)
        slo = self.tbt_slo_s or relative
        if slo <= 0 or self.cost is None:  # no SLO, or no model to predict with yet
            return TBTVerdict(True, 0.0, 0.0)
        batch = [r for r in self.requests.values() if r.state in ("running", "preempted")]
        return decode_tbt_check(self.cost, len(batch), sum(r.context_tokens for r in batch),
                                request.context_tokens, slo)

    def reject_kv(self, request_id: str, verdict: TBTVerdict) -> TokenChunk:
        """Refuse a request whose KV is all here (rejected after prefill): free its blocks now, and end it
        with an error the gateway answers as 429."""
        request = received(self.requests, request_id)
        del self.requests[request_id]
        self._release(request)
        self.stats["requests_rejected_tbt"] += 1
        return request.chunk([], "error", verdict.reason, error_status=429)

    def commit_kv(self, request_id: str, first_token: int, extras: bytes = b"") -> list[TokenChunk]:
        """All layers are in: emit the prefill's first token (with the logprobs in `extras`, a msgpack
        FirstToken, when asked for) and join the batch (or finish)."""
        request = received(self.requests, request_id)
        request.state, request.received = "running", None
        self.stats["kv_streams_committed"] += 1
        chunks = self._start(request, first_token, decode(extras, FirstToken) if extras else None)
        if request.staged is not None and request.key in self.requests:  # waits for blocks, as if preempted
            request.state = "preempted"
            self.preempted.append(request.key)
        return chunks

    def reset_kv(self, request_id: str) -> None:
        """Drop what arrived of a request's KV and wait for it again (the sender will resend)."""
        request = self.requests.get(request_id)
        if request is not None and request.state == "receiving":
            self.kv.free(request.blocks)
            self.staging.unstage(request)
            request.blocks, request.layer_tokens, request.state = [], [], "waiting_kv"
            request.received = None

    def received_blocks(self, request_id: str) -> tuple[list[int], list[int]]:
        """A request still receiving its KV (a push that breaks off now): its cache blocks whose every token arrived
        in every layer, and the prompt tokens they hold; none for one whose KV waits in host staging."""
        request = self.requests.get(request_id)
        if request is None or request.state != "receiving" or request.staged is not None or request.received is None:
            return [], []
        blocks = min(request.received.whole_blocks(self.kv.block_size), len(request.blocks))
        return request.blocks[:blocks], request.prompt[:blocks * self.kv.block_size]

    def adopt(self, job: DecodeJob, prompt: list[int], blocks: list[int], first_token: int,
              first: FirstToken | None = None) -> list[TokenChunk]:
        """Take over a request prefilled in this process (colocated): its blocks hold the prompt's KV."""
        request = DecodeRequest(job, deadline=0.0, state="running", blocks=blocks, prompt=list(prompt))
        self.requests[job.request_id] = request
        return self._start(request, first_token, first)

    # ---------------------------------------------------------------- parallel sampling

    def _start(self, request: DecodeRequest, first_token: int, first: FirstToken | None) -> list[TokenChunk]:
        """Emit the first token of each of the request's n sequences: the others fork from the first before
        it may finish and free its blocks."""
        siblings = []
        for index in range(1, request.job.sampling.n):
            sibling = fork(request, index, self.kv, self.runner)
            self.requests[sibling.key] = sibling
            if sibling.state == "preempted":
                self.preempted.append(sibling.key)
            else:
                self.stats["sequences_forked"] += 1
            siblings.append(sibling)
        chunks = [self._emit(request, first_token, first)]
        for sibling, token, logprob in zip(siblings, first.siblings if first else [], _padded(first)):
            chunks.append(self._emit(sibling, token, FirstToken(logprob=logprob)))
        return chunks

    # ---------------------------------------------------------------- ending

    def abort(self, request_id: str, reason: Literal["abort", "error"], error: str = "",
              status: int = 500) -> TokenChunk | None:
        """End a request (each of its sequences) and free its blocks; the first sequence's last chunk (an
        error answered with HTTP `status`), or None when it is not here (already ended)."""
        keys = [key for key, r in self.requests.items() if r.request_id == request_id]
        chunks = [self._end(key, reason, error, status) for key in keys]
        return chunks[0] if chunks else None

    def _end(self, key: str, reason: Literal["abort", "error"], error: str = "", status: int = 500) -> TokenChunk:
        request = self.requests.pop(key)
        self._release(request)
        self.stats["requests_aborted"] += 1
        return request.chunk([], reason, error, error_status=status)

    def expire(self, now: float) -> list[TokenChunk]:
        """Fail requests whose KV did not arrive in time."""
        late = [r.key for r in self.requests.values()
                if r.state in ("waiting_kv", "receiving") and now > r.deadline]
        return [self._end(rid, "error", "KV did not arrive in time", status=503) for rid in late]

    # ---------------------------------------------------------------- steps

    def schedule(self, hold: Collection[str] = ()) -> tuple[list[DecodeRequest], list[TokenChunk]]:
        """Requests for the next step, each with a slot for its new token; preempts when blocks run out.
        `hold`: requests that sit this step out (LayerKV's swap: their layers are not all on the device)."""
        failed = self._resume_preempted()
        running = [r for r in self.requests.values() if r.state == "running" and r.key not in hold]
        batch = []
        for request in running[: self.max_batch]:
            if request.state != "running":
                continue  # preempted below to make room for an older request
            if request.position >= len(request.blocks) * self.kv.block_size:
                if not self._make_room(request, running):
                    continue
                request.blocks += self.kv.allocate(1)
            batch.append(request)
        self._in_step = {r.key for r in batch}
        return batch, failed

    def execute(self, batch: list[DecodeRequest]) -> list[int]:
        masks = self.sampler.start(batch)  # the guided rows' masks, computed while the model runs (off the CPU)
        self._recompute([r for r in batch if r.recompute])
        logits = self.runner.decode([r.generated[-1] for r in batch], [r.position for r in batch],
                                    [r.blocks for r in batch])
        return self.sampler.choose_all(logits, batch, masks)

    def fail_step(self, batch: list[DecodeRequest], error: str) -> list[TokenChunk]:
        """The step in flight raised: end its requests with the error and free everything it held."""
        self._in_step = set()
        self.kv.end_step()
        return [self._end(r.key, "error", error) for r in batch if r.key in self.requests]

    def update(self, batch: list[DecodeRequest], tokens: list[int]) -> list[TokenChunk]:
        self.stats["decode_steps"] += 1
        self.stats["batch_size_sum"] += len(batch)
        self._in_step = set()
        self.kv.end_step()
        return [self._emit(r, t) for r, t in zip(batch, tokens) if r.key in self.requests]

    def occupancy(self) -> tuple[int, int]:
        """(running, waiting) sequences now: in the step batch, and admitted but not in it (their KV on its way,
        or preempted for blocks)."""
        running = sum(r.state == "running" for r in self.requests.values())
        return running, len(self.requests) - running

    @property
    def has_work(self) -> bool:
        return any(r.state in ("running", "preempted") for r in self.requests.values())

    # ---------------------------------------------------------------- preemption

    def _make_room(self, request: DecodeRequest, running: list[DecodeRequest]) -> bool:
        """Free a block for `request` by preempting the newest other running request; False if it is
        itself the one preempted."""
        while not self.kv.can_allocate(1):
            victim = next(r for r in reversed(running) if r.state == "running")  # `request` at the latest
            self.kv.free(victim.blocks)
            victim.blocks, victim.state = [], "preempted"
            self.preempted.append(victim.key)
            self.stats["preemptions"] += 1
            if victim is request:
                return False
        return True

    def _resume_preempted(self) -> list[TokenChunk]:
        """Give preempted requests blocks again (oldest first); their KV is recomputed in execute."""
        failed = []
        while self.preempted:
            request = self.requests.get(self.preempted[0])
            if request is None or request.state != "preempted":
                self.preempted.popleft()
                continue
            needed = self.kv.blocks_for(request.position + 1)
            if needed > self.kv.num_blocks:
                self.preempted.popleft()
                failed.append(self._end(request.key, "error", "sequence outgrew the KV cache"))
                continue
            if not self.kv.can_allocate(needed):
                break
            self.preempted.popleft()
            request.blocks, request.state = self.kv.allocate(needed), "running"
            request.recompute = not self.staging.load(request)
        return failed

    def _recompute(self, requests: list[DecodeRequest]) -> None:
        for request in requests:
            tokens = request.prompt + request.generated[:-1]
            self.runner.prefill(tokens, request.blocks, 0)
            self.stats["recomputed_tokens"] += len(tokens)
            request.recompute = False

    # ---------------------------------------------------------------- helpers

    def _emit(self, request: DecodeRequest, token: int, first: FirstToken | None = None) -> TokenChunk:
        """Record a generated token; the chunk carries its logprobs (the step's, or the prefill's in `first`)."""
        logprob = first.logprob if first is not None else request.next_logprob
        request.next_logprob = None
        request.generated.append(token)
        self.stats["tokens_generated"] += 1
        reason = finish_reason(token, len(request.generated), request.job.sampling,
                               self.runner.config.eos_token_ids)
        if reason is not None:
            del self.requests[request.key]
            self._release(request)
            self.stats["requests_finished"] += 1
        return request.chunk([token], reason, logprobs=None if logprob is None else [logprob],
                             prompt_logprobs=first.prompt_logprobs if first is not None else None)

    def _release(self, request: DecodeRequest) -> None:
        self.staging.unstage(request)
        self.guides.forget(request.key)
        if request.key in self._in_step:  # the step in flight still reads and writes its blocks
            self.kv.free_after_step(request.blocks)
            return
        self.kv.free(request.blocks)
        request.blocks = []




def expect(requests: dict[str, DecodeRequest], request_id: str, state: str) -> DecodeRequest:
    """The request `request_id` of `requests`, in `state`; else `KVRejected`."""
    request = requests.get(request_id)
    if request is None:
        raise KVRejected(f"request {request_id} is not expected here")
    if request.state != state:
        raise KVRejected(f"request {request_id} is {request.state}, not {state}")
    return request


def received(requests: dict[str, DecodeRequest], request_id: str) -> DecodeRequest:
    """The request `request_id` of `requests`, receiving KV, with every layer of it arrived; else `KVRejected`."""
    request = expect(requests, request_id, "receiving")
    incomplete = [i for i, n in enumerate(request.layer_tokens) if n != request.job.n_prompt_tokens]
    if incomplete:
        raise KVRejected(f"request {request_id}: commit with layers {incomplete[:4]} incomplete")
    return request


def fork(parent: DecodeRequest, index: int, kv: KVCacheManager, runner: ModelRunner) -> DecodeRequest:
    """Sequence `index` of a request: the prompt's full blocks shared with the first sequence (their reference
    counts), the block it writes next its own (a copy of the prompt's partial last block). With no room it starts
    preempted and recomputes its KV when blocks free up."""
    sibling = DecodeRequest(parent.job, deadline=0.0, state="running", prompt=parent.prompt, index=index)
    full = parent.job.n_prompt_tokens // kv.block_size
    own = len(parent.blocks) - full
    if not kv.can_allocate(own):
        sibling.state = "preempted"
        return sibling
    sibling.blocks = kv.allocate(own, parent.blocks[:full])
    if parent.job.n_prompt_tokens % kv.block_size:
        runner.copy_block(parent.blocks[full], sibling.blocks[full])
    return sibling


def _padded(first: FirstToken | None) -> list[TokenLogprob | None]:
    """The siblings' first-token logprobs, None for each when none were asked for."""
    if first is None:
        return []
    return [*first.sibling_logprobs, *[None] * (len(first.siblings) - len(first.sibling_logprobs))]
