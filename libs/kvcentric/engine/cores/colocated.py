"""The colocated role (the baseline Mooncake compares against, as vLLM runs): one instance prefills and
decodes, sharing one KV pool. Each step runs one prefill chunk, then one decode step of the continuous
batch; a finished prompt hands its blocks straight to decode, so no KV moves (its full blocks enter the host
pool behind the compute, `engine/kv/hostwrite.py`, never before its first token). No I/O, no clock.
"""

from __future__ import annotations

from kvcentric.core.block_pool import BlockPool
from kvcentric.core.kv_cache import KVCacheManager
from kvcentric.engine.cores.decode import DecodeEngine
from kvcentric.engine.cores.sequence import DecodeRequest
from kvcentric.engine.cores.prefill import PrefillChunk, PrefillEngine
from kvcentric.engine.model.runner import ModelRunner
from kvcentric.core.hashing import BlockHasher
from kvcentric.engine.kv.kvpool import HostBlockPool
from kvcentric.engine.cores.layerkv import LayerKV
from kvcentric.core.protocol import DecodeJob, PrefillJob, TokenChunk


class ColocatedEngine:
    def __init__(self, runner: ModelRunner, pool: BlockPool, hasher: BlockHasher, chunk_tokens: int = 512,
                 max_batch: int = 64, host: HostBlockPool | None = None, layerkv: LayerKV | None = None,
                 layerwise_load: bool = True, layerwise_store: bool = True) -> None:
        """`layerkv`: admit prompts and place their layers as LayerKV does (its pool is `pool`);
        `layerwise_load`, `layerwise_store`: host-pool prefixes load, and new blocks are stored, layer by layer
        beside the compute (Mooncake §5.2)."""
        self.runner, self.pool, self.layerkv = runner, pool, layerkv
        self.kv = KVCacheManager(pool)
        """The one cache manager both roles allocate through."""
        self.prefill = PrefillEngine(runner, pool, hasher, chunk_tokens, host, layerwise_load, layerwise_store,
                                     kv=self.kv)
        self.decode = DecodeEngine(runner, pool, max_batch, kv=self.kv)
        self.jobs: dict[str, DecodeJob] = {}

    def submit(self, prefill_job: PrefillJob, decode_job: DecodeJob | None = None) -> None:
        """Queue a prompt; its decode job comes here or was registered with `decode.add` before."""
        self.prefill.submit(prefill_job)
        if decode_job is not None:
            self.jobs[prefill_job.request_id] = decode_job

    def cancel(self, request_id: str) -> TokenChunk | None:
        self.jobs.pop(request_id, None)
        self.prefill.cancel(request_id)
        return self.decode.abort(request_id, "abort")

    @property
    def has_work(self) -> bool:
        writing = self.prefill.writer is not None and self.prefill.writer.busy
        return bool(self.prefill.queue or self.prefill.running) or writing or self.decode.has_work

    def schedule(self, now: float = 0.0) -> tuple[PrefillChunk | None, list[DecodeRequest], list[TokenChunk]]:
        """`now`: the time LayerKV's scheduler measures the decoding requests' progress by."""
        if self.layerkv is None:
            chunk = self.prefill.schedule()
            batch, failed = self.decode.schedule()
        else:
            chunk = self.prefill.schedule() if self.layerkv.admit(self.prefill, self.decode, now) else None
            self.layerkv.placed(self.prefill, now)
            batch, failed = self.decode.schedule(hold=self.layerkv.held(self.decode))
        return chunk, batch, failed

    def execute(self, chunk: PrefillChunk | None, batch: list[DecodeRequest]) -> tuple[int | None, list[int]]:
        first = self.prefill.execute(chunk) if chunk is not None else None
        return first, self.decode.execute(batch) if batch else []

    def update(self, chunk: PrefillChunk | None, first: int | None, batch: list[DecodeRequest],
               tokens: list[int]) -> list[TokenChunk]:
        out = self.decode.update(batch, tokens) if batch else []
        if chunk is not None:
            self.prefill.update(chunk)
            if chunk.last:
                assert first is not None, "the last chunk of a prompt samples its first token"
                out += self._hand_over(chunk, first)
        return out

    def fail_step(self, chunk: PrefillChunk | None, batch: list[DecodeRequest], error: str) -> list[TokenChunk]:
        """The step raised: end the prompt in progress and the decode batch with the error."""
        out: list[TokenChunk | None] = [*self.decode.fail_step(batch, error)]
        if chunk is not None and chunk.work.request_id in self.prefill.running:
            self.jobs.pop(chunk.work.request_id, None)
            self.prefill.finish(chunk.work)
            out.append(self.decode.abort(chunk.work.request_id, "error", error))
        return [c for c in out if c is not None]

    def step(self, now: float = 0.0) -> list[TokenChunk]:
        """schedule, execute, update in one call (for benchmarks and tests)."""
        chunk, batch, failed = self.schedule(now)
        first, tokens = self.execute(chunk, batch)
        return failed + self.update(chunk, first, batch, tokens)

    def _hand_over(self, chunk: PrefillChunk, first_token: int) -> list[TokenChunk]:
        work = chunk.work
        waiting = self.decode.requests.get(work.request_id)
        job = self.jobs.pop(work.request_id, None) or (waiting.job if waiting and not waiting.blocks else None)
        if job is None or work.cancelled:
            self.prefill.finish(work)
            return []
        self.kv.share(work.blocks)  # decode's reference; finish() drops prefill's
        self.prefill.finish(work)
        return self.decode.adopt(job, work.job.token_ids, work.blocks, first_token, work.first_token())
