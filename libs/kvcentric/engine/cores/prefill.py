"""The prefill role: a FIFO of prompts, prefix reuse from the local block pool, chunked prefill.

`submit` queues a job; `schedule` returns the next chunk of work, pinning a prompt's blocks when it starts (its
computed prefix shared, the rest allocated, both through the `KVCacheManager`); `execute` runs one chunk (torch,
may run in a worker thread) with a hook after each layer; `finish` caches the prompt's full blocks, hands those
the host pool lacks to the write-behind worker (`HostWriter`: they enter the host pool behind the compute) and
drops the prompt's references. No I/O; time is not needed.
"""

from __future__ import annotations

import collections
import dataclasses

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.kv_cache import KVCacheManager
from kvcentric.engine.cores.prefill_host import HostTier
from kvcentric.engine.model.guided import Guides
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.engine.model.sampling import adjust, choose, draw_rows, prompt_logprobs
from kvcentric.core.hashing import BlockHasher, to_hex
from kvcentric.core.migration import history
from kvcentric.engine.kv.hostwrite import LayerStore
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.kv.layerload import LayerwiseLoad
from kvcentric.engine.model.llama import LayerHook
from kvcentric.core.protocol import FirstToken, PrefillJob, TokenLogprob, encode


class PrefillRejected(ValueError):
    """A job this engine will not queue (duplicate id, prompt too long for the model or the pool)."""


@dataclasses.dataclass
class PrefillWork:
    job: PrefillJob
    blocks: list[int]
    num_cached: int
    """Leading prompt tokens whose KV was already in the pool (not computed)."""
    hashes: list[str]
    done: int = 0
    """Prompt tokens whose KV is in the cache (cached prefix plus chunks computed so far)."""
    cancelled: bool = False
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    """Asked for (`sampling.prompt_logprobs`): prompt tokens 1..done scored so far."""
    first_logprob: TokenLogprob | None = None
    """Asked for (`sampling.logprobs`): the first generated token's, once the last chunk is computed."""
    siblings: list[tuple[int, TokenLogprob | None]] = dataclasses.field(default_factory=list)
    """With n > 1: the first token (and its logprobs) of sequences 1..n-1."""
    loading: LayerwiseLoad | None = None
    """Prefix blocks still coming from the host pool, layer by layer (Mooncake §5.2), until the first chunk."""
    storing: LayerStore | None = None
    """The scheduled chunk's blocks on their way into the host pool layer by layer, until `update`."""

    @property
    def request_id(self) -> str:
        return self.job.request_id

    def first_token_extras(self) -> bytes:
        """What goes to decode with the first token: the logprobs asked for (msgpack FirstToken), or b""."""
        sampling = self.job.sampling
        if sampling.logprobs is None and sampling.prompt_logprobs is None and sampling.n == 1:
            return b""
        return encode(self.first_token())

    def first_token(self) -> FirstToken:
        """The logprobs asked for and the other sequences' first tokens, for decode."""
        logprobs = [logprob for _, logprob in self.siblings if logprob is not None]
        return FirstToken(logprob=self.first_logprob, prompt_logprobs=self.prompt_logprobs,
                          siblings=[token for token, _ in self.siblings], sibling_logprobs=logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.job.token_ids)


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    work: PrefillWork
    start: int
    end: int
    store: LayerStore | None = None
    """The blocks this chunk fills, going into the host pool layer by layer as it computes (Mooncake §5.2)."""

    @property
    def first(self) -> bool:
        return self.start == self.work.num_cached

    @property
    def last(self) -> bool:
        return self.end == self.work.num_tokens


class PrefillEngine:
    def __init__(self, runner: ModelRunner, pool: BlockPool, hasher: BlockHasher, chunk_tokens: int = 512,
                 host: HostBlockPool | None = None, layerwise_load: bool = True,
                 layerwise_store: bool = True, kv: KVCacheManager | None = None) -> None:
        """`kv`: the cache manager over `pool` when another role of the instance shares it (colocated)."""
        if hasher.block_size != pool.block_size:
            raise ValueError("the hasher's block size must equal the pool's")
        if chunk_tokens < 1:
            raise ValueError("chunk_tokens must be at least 1")
        self.runner, self.pool, self.hasher, self.chunk_tokens = runner, pool, hasher, chunk_tokens
        self.kv = kv if kv is not None else KVCacheManager(pool)
        """Every block this engine takes, shares and frees goes through it."""
        self.queue: collections.deque[PrefillJob] = collections.deque()
        self.guides = Guides(runner.config)
        """Structured output's grammar state of each guided sequence (its first token is sampled here)."""
        self.running: dict[str, PrefillWork] = {}
        self.computing: set[str] = set()
        """Prompts whose chunk is being computed now, by a second model thread's pass or the first's (a prefill
        instance with a lane, `node.Lane`): `schedule` picks another."""
        self.sending: dict[str, PrefillWork] = {}
        """Prompts computed whose KV is still on its way out (`complete`): blocks held until `finish`."""
        self.stats = {"prefill_tokens_computed": 0, "prefill_tokens_cached": 0, "prefill_tokens_from_host": 0,
                      "prefill_chunks": 0, "prefill_passes": 0, "requests_prefilled": 0, "requests_cancelled": 0,
                      "prefix_load_wait_seconds": 0.0}
        self.tier = HostTier(runner, self.kv, host, layerwise_load, layerwise_store, self.stats)
        """The node's host-memory pool: prefixes missing from the cache are loaded from it, and every
        computed full block is written to it behind the compute."""
        self.host, self.writer = host, self.tier.writer

    @property
    def queued_tokens(self) -> int:
        pending = sum(w.num_tokens - w.done for w in self.running.values())
        return pending + sum(len(job.token_ids) for job in self.queue)

    @property
    def waiting_tokens(self) -> int:
        """`queued_tokens` less those of the prompts computed now (`computing`)."""
        pending = sum(w.num_tokens - w.done for w in self.idle_running())
        return pending + sum(len(job.token_ids) for job in self.queue)

    def idle_running(self) -> list[PrefillWork]:
        """The prompts in progress, in order, but those computed now (`computing`)."""
        return [w for key, w in self.running.items() if key not in self.computing]

    def submit(self, job: PrefillJob) -> None:
        self.check(job)
        self.queue.append(job)

    def check(self, job: PrefillJob) -> None:
        """Raise PrefillRejected for a job this engine would not queue."""
        if self.holds(job.request_id) or any(q.request_id == job.request_id for q in self.queue):
            raise PrefillRejected(f"request {job.request_id} is already here")
        if not 0 < len(job.token_ids) < self.runner.config.max_position:
            raise PrefillRejected(f"prompt of {len(job.token_ids)} tokens; this model takes 1.."
                                  f"{self.runner.config.max_position - 1}")
        if not 0 <= job.kv_skip_tokens < len(job.token_ids):
            raise PrefillRejected(f"kv_skip_tokens {job.kv_skip_tokens}: the KV of at least the last prompt "
                                  f"token must be pushed")
        vocab = self.runner.config.vocab_size
        if min(job.token_ids) < 0 or max(job.token_ids) >= vocab:
            raise PrefillRejected(f"token ids must be in [0, {vocab})")
        if self.kv.blocks_for(len(job.token_ids)) > self.kv.num_blocks:
            raise PrefillRejected(f"prompt of {len(job.token_ids)} tokens exceeds the KV pool")

    def cancel(self, request_id: str) -> bool:
        for job in self.queue:
            if job.request_id == request_id:
                self.queue.remove(job)
                self.stats["requests_cancelled"] += 1
                return True
        work = self.running.get(request_id) or self.sending.get(request_id)
        if work is not None:
            work.cancelled = True
        return work is not None

    def schedule(self) -> PrefillChunk | None:
        """The next chunk: of the prompt in progress, else of the next queued one whose blocks fit."""
        if self.writer is not None:
            self.writer.collect()
        work = next(iter(self.idle_running()), None) or self._start_next()
        if work is None:
            return None
        end = min(work.done + self.chunk_tokens, work.num_tokens)
        work.storing = self.tier.store_for(work.blocks, work.hashes, work.done, end)
        return PrefillChunk(work, work.done, end, work.storing)

    def schedule_step(self, budget: int) -> list[PrefillChunk]:
        """Chunks of as many prompts as fit `budget` tokens, computed in one pass (`execute_step`): the next
        chunk as `schedule` picks it, then the other prompts in progress and queued ones while their blocks
        fit, each chunk at most `chunk_tokens`. A prompt that needs every row's logits (prompt logprobs) or
        whose prefix is still loading from the host pool layer by layer (Mooncake §5.2) runs alone; so does
        everything with `budget` 0 or under LayerKV."""
        first = self.schedule()
        if first is None:
            return []
        chunks = [first]
        left = budget - (first.end - first.start)
        if budget <= 0 or self.runner.layered is not None or not self._batchable(first.work):
            return chunks
        taken = {first.work.request_id, *self.computing}
        while left > 0:
            work = next((w for key, w in self.running.items() if key not in taken), None) or self._start_next()
            if work is None or not self._batchable(work):
                break
            taken.add(work.request_id)
            end = min(work.done + min(self.chunk_tokens, left), work.num_tokens)
            work.storing = self.tier.store_for(work.blocks, work.hashes, work.done, end)
            chunks.append(PrefillChunk(work, work.done, end, work.storing))
            left -= end - work.done
        return chunks

    @staticmethod
    def _batchable(work: PrefillWork) -> bool:
        return work.job.sampling.prompt_logprobs is None and work.loading is None

    def execute_step(self, chunks: list[PrefillChunk], hooks: list[LayerHook | None]) -> list[int | None]:
        """Compute the chunks of `schedule_step` (one pass for several), each with its own layer hook (its rows
        of every layer); the first generated token of each chunk that ends its prompt, None for the others."""
        self.stats["prefill_passes"] += 1
        if len(chunks) == 1:
            return [self.execute(chunks[0], hooks[0])]
        hooks = [self.tier.storing(c.store, hook) if c.store is not None else hook
                 for c, hook in zip(chunks, hooks)]
        sizes = [c.end - c.start for c in chunks]

        def on_layer(layer: int, keys, values) -> None:
            row = 0
            for size, hook in zip(sizes, hooks):
                if hook is not None:
                    hook(layer, keys[row:row + size], values[row:row + size])
                row += size
        logits = self.runner.prefill_many([(c.work.job.token_ids, c.work.blocks, c.start, c.end) for c in chunks],
                                          on_layer)
        return [self.sample_first(c.work, logits[i]) if c.last else None for i, c in enumerate(chunks)]

    def _start_next(self) -> PrefillWork | None:
        if not self.queue:
            return None
        job = self.queue[0]
        hashes = self.hashes(job.token_ids)
        usable = (len(job.token_ids) - 1) // self.kv.block_size  # compute at least one token: its logits
        cached = self.kv.computed_blocks(hashes, usable)
        from_host = self.tier.prefix(hashes[len(cached):])
        if job.sampling.prompt_logprobs is not None:  # a cached prefix has no logits to score it with
            cached, from_host = [], 0
        from_host = max(0, min(from_host, usable - len(cached)))
        needed = self.kv.blocks_for(len(job.token_ids)) - len(cached)
        if not self._fits(cached, needed):
            return None
        self.queue.popleft()
        blocks = self.kv.allocate(needed, cached)
        loading = self.tier.load(blocks, hashes, len(cached), from_host)
        num_cached = (len(cached) + from_host) * self.kv.block_size
        work = PrefillWork(job, blocks, num_cached, hashes, done=num_cached, loading=loading)
        self.running[job.request_id] = work
        return work

    def _fits(self, cached: list[int], needed: int) -> bool:
        """Whether `needed` new blocks can be allocated once the unreferenced `cached` ones are taken off the
        free list; while they cannot, blocks still being written to the host pool are waited for (they
        must not be reused before their bytes are there)."""
        while True:
            if self.kv.can_allocate(needed, cached):
                return True
            if self.writer is None or not self.writer.busy:
                return False
            self.writer.wait_oldest()

    def hashes(self, token_ids: list[int]) -> list[str]:
        return [to_hex(h) for h in self.hasher.hash_blocks(token_ids)]

    def _end_store(self, work: PrefillWork, computed: bool) -> None:
        if work.storing is not None:
            self.tier.end_store(work.storing, computed)
            work.storing = None

    def settle(self, work: PrefillWork, wait: bool = True) -> None:
        """End the prompt's layer-wise load: every layer in the cache (`wait`: the compute stream waits for
        the copies), the copies finished, the host slots unpinned."""
        loading, work.loading = work.loading, None
        if loading is None:
            return
        try:
            self.tier.end_load(loading, wait)
        finally:
            if loading.error is not None:  # the prefix is not in the cache: not counted done either
                work.done = work.num_cached = work.blocks.index(loading.blocks[0]) * self.kv.block_size

    def execute(self, chunk: PrefillChunk, on_layer: LayerHook | None = None) -> int | None:
        """Compute one chunk; after the last chunk, return the first generated token."""
        work, sampling = chunk.work, chunk.work.job.sampling
        scored = sampling.prompt_logprobs is not None
        if chunk.store is not None:
            on_layer = self.tier.storing(chunk.store, on_layer)
        if work.loading is None:
            logits = self.runner.prefill(work.job.token_ids, work.blocks, chunk.start, chunk.end, on_layer, scored)
        else:
            try:
                logits = self.runner.prefill(work.job.token_ids, work.blocks, chunk.start, chunk.end, on_layer,
                                             scored, work.loading.wait)
            finally:
                self.settle(work, wait=False)
        if scored:
            following = work.job.token_ids[chunk.start + 1:chunk.end + 1]
            work.prompt_logprobs += prompt_logprobs(logits, following, sampling.prompt_logprobs or 0)
            logits = logits[-1]
        return self.sample_first(work, logits) if chunk.last else None

    def sample_first(self, work: PrefillWork, logits) -> int:
        """The prompt's first generated token from its last position's logits (and its siblings' with n > 1);
        a migrated request's resumed tokens count as output (`history`)."""
        sampling, eos = work.job.sampling, self.runner.config.eos_token_ids
        prompt, output = history(sampling, work.job.token_ids, ())
        request_id = work.job.request_id
        allowed = self.guides.mask(request_id, sampling, output)  # the n sequences' (their output is the same)
        self.guides.forget(request_id)  # they go on on decode, which replays their output there
        if sampling.n > 1 and sampling.logprobs is None:  # the n draws from one row of logits, together
            adjusted = adjust(logits.float(), sampling, prompt, output, eos, allowed)
            tokens = draw_rows(adjusted.expand(sampling.n, -1), [sampling] * sampling.n, [len(output)] * sampling.n,
                               range(sampling.n))
            work.first_logprob, work.siblings = None, [(token, None) for token in tokens[1:]]
            return tokens[0]
        token, work.first_logprob = choose(logits, sampling, len(output), prompt, output, eos, 0, allowed)
        work.siblings = [choose(logits, sampling, len(output), prompt, output, eos, index, allowed)
                         for index in range(1, sampling.n)]
        return token

    def update(self, chunk: PrefillChunk) -> None:
        """Record a computed chunk."""
        chunk.work.done = chunk.end
        self._end_store(chunk.work, computed=True)
        self.stats["prefill_tokens_computed"] += chunk.end - chunk.start
        self.stats["prefill_chunks"] += 1

    def holds(self, request_id: str) -> bool:
        """The request's blocks are held here: being computed, or computed and still being sent."""
        return request_id in self.running or request_id in self.sending

    def complete(self, work: PrefillWork) -> None:
        """The prompt is computed but its KV is still being sent: the next prompt may start, and share its
        full blocks (findable by hash from now on), which stay held until `finish`."""
        self.sending[work.request_id] = self.running.pop(work.request_id)
        self._cache_computed(work)

    def _cache_computed(self, work: PrefillWork) -> int:
        computed_blocks = min(len(work.hashes), work.done // self.kv.block_size)
        self.kv.cache(work.blocks[:computed_blocks], work.hashes[:computed_blocks])
        return computed_blocks

    def finish(self, work: PrefillWork) -> None:
        """Release the prompt's blocks; its computed full blocks stay findable by hash."""
        if self.running.pop(work.request_id, None) is None:
            del self.sending[work.request_id]
        self.settle(work, wait=False)  # a prompt cancelled before its first chunk: its copies end first
        self._end_store(work, computed=False)  # a chunk that failed or never ran: its slots go back
        computed_blocks = self._cache_computed(work)
        if self.writer is not None:  # every computed full block enters the host pool (Mooncake §3), behind
            self.writer.submit(work.blocks[:computed_blocks], work.hashes[:computed_blocks])
        if work.done == work.num_tokens:
            self.stats["prefill_tokens_cached"] += work.num_cached
            self.stats["requests_prefilled"] += 1
        self.kv.free(work.blocks)
