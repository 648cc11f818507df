"""The prefill role: a queue of prompts, prefix reuse from the local block pool, one prompt per step.

`submit` queues a job; `schedule` takes the next one and pins its blocks (cached prefix shared, the
rest allocated); `execute` runs the model (torch, may run in a worker thread) calling a hook after each
layer; `finish` caches the prompt's full blocks and drops the references. No I/O, time passed in.
"""

from __future__ import annotations

import collections
import dataclasses

from kvcentric.engine.block_pool import BlockPool
from kvcentric.engine.runner import ModelRunner, sample
from kvcentric.hashing import BlockHasher, to_hex
from kvcentric.model.llama import LayerHook
from kvcentric.protocol import PrefillJob


class PrefillRejected(ValueError):
    """A job this engine will not queue (duplicate id, prompt too long for the model or the pool)."""


@dataclasses.dataclass
class PrefillWork:
    job: PrefillJob
    blocks: list[int]
    num_cached: int
    hashes: list[str]
    cancelled: bool = False

    @property
    def request_id(self) -> str:
        return self.job.request_id


class PrefillEngine:
    def __init__(self, runner: ModelRunner, pool: BlockPool, hasher: BlockHasher) -> None:
        if hasher.block_size != pool.block_size:
            raise ValueError("the hasher's block size must equal the pool's")
        self.runner, self.pool, self.hasher = runner, pool, hasher
        self.queue: collections.deque[PrefillJob] = collections.deque()
        self.running: dict[str, PrefillWork] = {}
        self.stats = {"prefill_tokens_computed": 0, "prefill_tokens_cached": 0, "requests_prefilled": 0,
                      "requests_cancelled": 0}

    @property
    def queued_tokens(self) -> int:
        return sum(len(job.token_ids) for job in self.queue)

    def submit(self, job: PrefillJob) -> None:
        if job.request_id in self.running or any(q.request_id == job.request_id for q in self.queue):
            raise PrefillRejected(f"request {job.request_id} is already here")
        if not 0 < len(job.token_ids) < self.runner.config.max_position:
            raise PrefillRejected(f"prompt of {len(job.token_ids)} tokens; this model takes 1.."
                                  f"{self.runner.config.max_position - 1}")
        if self.pool.blocks_for(len(job.token_ids)) > self.pool.num_blocks:
            raise PrefillRejected(f"prompt of {len(job.token_ids)} tokens exceeds the KV pool")
        self.queue.append(job)

    def cancel(self, request_id: str) -> bool:
        for job in self.queue:
            if job.request_id == request_id:
                self.queue.remove(job)
                self.stats["requests_cancelled"] += 1
                return True
        work = self.running.get(request_id)
        if work is not None:
            work.cancelled = True
        return work is not None

    def schedule(self) -> PrefillWork | None:
        """Pin blocks for the next queued prompt, or None when the queue is empty or the pool full."""
        if not self.queue:
            return None
        job = self.queue[0]
        hashes = [to_hex(h) for h in self.hasher.hash_blocks(job.token_ids)]
        cached = self.pool.cached_prefix(hashes)
        if len(cached) * self.pool.block_size >= len(job.token_ids):
            cached = cached[:-1]  # keep at least one token to compute: its logits give the first token
        needed = self.pool.blocks_for(len(job.token_ids)) - len(cached)
        if not self.pool.can_allocate(needed):
            return None
        self.pool.share(cached)
        self.queue.popleft()
        work = PrefillWork(job, cached + self.pool.allocate(needed), len(cached) * self.pool.block_size, hashes)
        self.running[job.request_id] = work
        return work

    def execute(self, work: PrefillWork, on_layer: LayerHook | None = None) -> int:
        """Run the uncached part of the prompt; return the first generated token."""
        logits = self.runner.prefill(work.job.token_ids, work.blocks, work.num_cached, on_layer)
        return sample(logits, work.job.sampling, 0)

    def finish(self, work: PrefillWork, computed: bool) -> None:
        """Release the prompt's blocks; when computed, its full blocks stay findable by hash."""
        del self.running[work.request_id]
        if computed:
            self.pool.cache(work.blocks[: len(work.hashes)], work.hashes)
            self.stats["prefill_tokens_computed"] += len(work.job.token_ids) - work.num_cached
            self.stats["prefill_tokens_cached"] += work.num_cached
            self.stats["requests_prefilled"] += 1
        self.pool.free(work.blocks)
