"""Simulated serving instances: a prefill instance (FIFO, one prompt at a time, host-memory prefix cache,
pulls of named prefixes), and a batch instance that decodes in continuous batches and, when colocated,
also prefills like vLLM (a prefill step that stalls the batch, or chunked prefill mixed into each step).
They model time with the cost model and report load; they make no placement decision.

Mooncake §3-§5: prefill reuses the prefix it holds, loads a named remote prefix layer by layer while it
computes (so it takes the longer of the two), stores the new blocks in its DRAM pool, and streams KV to
decode layer by layer; decode double-checks its TBT SLO when the KV arrives and may reject (the prefill
is then wasted), otherwise the request joins the next step of the continuous batch. A PrfaaS prefill
instance (PrfaaS §3.3) runs on its cluster's cost model and its KV crosses the inter-cluster link.
"""

from __future__ import annotations

import bisect
import collections
from typing import TYPE_CHECKING

from kvcentric.core.costmodel import CostModel
from kvcentric.core.protocol import LoadReport, MeasuredCost
from kvcentric.core.scheduling.models import as_measured
from kvcentric.core.scheduling.eviction import BlockCache
from kvcentric.core.sim.batch import DecodeBatch
from kvcentric.core.sim.metrics import Record

if TYPE_CHECKING:
    from kvcentric.core.sim.cluster import Simulation


class PrefillInstance:
    def __init__(self, sim: Simulation, instance_id: str, cache: BlockCache, cluster: str = "sim",
                 cost: CostModel | None = None, remote: bool = False) -> None:
        self.sim, self.instance_id, self.cache = sim, instance_id, cache
        # remote: a PrfaaS instance, whose KV crosses the inter-cluster link to decode
        self.cluster, self.cost, self.remote = cluster, cost or sim.cost, remote
        self.announce: MeasuredCost | None = as_measured(cost, instance_id) if cost is not None and not remote else None
        """Its own model, in its first load report (an instance of a pool with its own profile)."""
        self.queue: collections.deque[Record] = collections.deque()
        self.current: Record | None = None
        self.busy_until = 0.0
        self.kv_bytes_sent = 0
        self.pipeline: tuple[str, int] | None = None
        """(group, stages) when this is the first stage of a simulated prefill group."""

    def submit(self, record: Record, now: float) -> None:
        self.queue.append(record)
        if self.current is None:
            self._start(now)

    def queue_s(self, now: float) -> float:
        """Seconds of work here: the rest of the current prompt plus the predictions of the queued ones."""
        rest = max(0.0, self.busy_until - now) if self.current is not None else 0.0
        return rest + sum(r.predicted_prefill_s for r in self.queue)

    def _start(self, now: float) -> None:
        record = self.current = self.queue.popleft()
        cached_blocks, ready_at = self.sim.reuse_prefix(self, record, now)
        compute_s = self.sim.prefill_seconds(record, cached_blocks, cost=self.cost)
        self.busy_until = max(now + compute_s, ready_at)
        record.prefill_start = now
        self.sim.at(self.busy_until, self._finish, record, compute_s)
        self.sim.report(self.load_report(now), now)

    def _finish(self, now: float, record: Record, compute_s: float) -> None:
        self.sim.store_blocks(self, record.request.hashes)
        self.current = None
        self.sim.prefill_done(record, now, compute_s, sender=self)
        if self.queue:
            self._start(now)
        else:
            self.sim.report(self.load_report(now), now)

    def load_report(self, now: float) -> LoadReport:
        queued = sum(r.request.input_len for r in self.queue)
        group, stages = self.pipeline or ("", 1)
        return LoadReport(instance_id=self.instance_id, role="prefill", cluster=self.cluster, kv_addr=self.instance_id,
                          queued_requests=len(self.queue), queued_tokens=queued,
                          running=int(self.current is not None), kv_blocks_total=0, kv_blocks_free=0, ts=now,
                          est_queue_s=self.queue_s(now), kv_bytes_sent=self.kv_bytes_sent, cost=self._announced(),
                          pipeline_group=group, stages=stages)

    def _announced(self) -> MeasuredCost | None:
        announce, self.announce = self.announce, None
        return announce


class BatchInstance:
    """Continuous-batching decode; with `colocated` it also prefills (vLLM-like, optionally chunked)."""

    def __init__(self, sim: Simulation, instance_id: str, capacity_tokens: float, *, colocated: bool = False,
                 cache: BlockCache | None = None, chunk_tokens: int = 0, cluster: str = "sim",
                 max_batch: int = 0, cost: CostModel | None = None) -> None:
        self.sim, self.instance_id, self.cluster = sim, instance_id, cluster
        self.capacity_tokens = capacity_tokens
        self.max_batch = max_batch
        """Most sequences decoding at once (0: only the KV capacity limits the batch)."""
        self.colocated, self.cache, self.chunk_tokens = colocated, cache, chunk_tokens
        self.batch: DecodeBatch[Record] = DecodeBatch(cost or sim.cost)
        self.announce: MeasuredCost | None = as_measured(cost, instance_id) if cost is not None else None
        """Its own model, in its first load report (an instance of a pool with its own profile)."""
        self.joining: collections.deque[Record] = collections.deque()
        """KV arrived (or prefill done here): joins at the next step boundary, capacity permitting."""
        self.waiting: collections.deque[Record] = collections.deque()
        """Colocated: requests waiting for their prefill."""
        self.reserved = 0
        """KV tokens promised to admitted requests (prompt plus whole output)."""
        self.segment: tuple[float, int] | None = None
        self.stepping = False
        self.version = 0
        self.prefill_done_tokens = 0
        self.prefill_compute_s = 0.0
        self.gap_end: list[float] = []
        self.gap_s: list[float] = []
        """The longest time between two tokens of the batch, per segment or step, by end time."""
        self.slow_total: list[int] = []
        """Running count of steps whose gap exceeded the TBT SLO, at each of those end times."""

    # ---------------------------------------------------------------- arrivals

    def kv_arrived(self, now: float, record: Record) -> None:
        """Disaggregated decode: the local TBT double-check (§3 step 4), then join or reject."""
        if not self.sim.decode_accepts(self, record, now):
            self.sim.rejected_after_prefill(record, now)
            return
        self.joining.append(record)
        self._wake(now)

    def submit_prefill(self, record: Record, now: float) -> None:
        self.waiting.append(record)
        self._wake(now)

    def kv_now(self, now: float) -> int:
        """Context tokens in the batch now, counting the steps of the segment in progress."""
        if self.segment is None:
            return self.batch.kv_tokens
        start, _ = self.segment
        return self.batch.kv_tokens + len(self.batch) * self.batch.steps_within(now - start)

    def batch_size(self) -> int:
        return len(self.batch) + len(self.joining)

    def _wake(self, now: float) -> None:
        """New work: start stepping if idle, or cut the decode segment at its next step boundary."""
        if self.stepping:
            if self.segment is not None:
                start, planned = self.segment
                done = self.batch.steps_within(now - start) + 1
                if done < planned:
                    self._schedule_segment(start, done)
            return
        self._next(now)
        self.sim.report_batch(self, now)

    # ---------------------------------------------------------------- stepping

    def _schedule_segment(self, start: float, steps: int) -> None:
        self.version += 1
        self.segment = (start, steps)
        self.sim.at(start + self.batch.duration(steps), self._segment_end, self.version)

    def _segment_end(self, now: float, version: int) -> None:
        if version != self.version:
            return
        assert self.segment is not None  # the version matches: this is the segment scheduled last
        _, steps = self.segment
        self.segment = None
        first, growth = self.batch.first_step_s(), self.batch.cost.decode[2] * len(self.batch)
        self._note_gap(now, first + growth * (steps - 1), _slow_steps(first, growth, steps, self.sim.tbt_slo_s))
        self._retire(self.batch.advance(steps), now)
        self._next(now)
        self.sim.report_batch(self, now)

    def _retire(self, finished: list[Record], now: float) -> None:
        for record in finished:
            context = record.request.input_len + record.request.output_len
            self.batch.release(context)
            self.reserved -= context
            record.finish = now
            since = bisect.bisect_right(self.gap_end, record.first_token)
            record.max_gap_s = max(self.gap_s[since:], default=0.0)
            record.slow_gaps = self.slow_total[-1] - self.slow_total[since - 1] if since else self.slow_total[-1]
            self.sim.finished(record, now)

    def _note_gap(self, now: float, seconds: float, slow: int | None = None) -> None:
        """Every sequence in the batch just had a gap of up to `seconds`; `slow` of them exceeded the SLO."""
        if len(self.batch):
            self.gap_end.append(now)
            self.gap_s.append(seconds)
            slow = int(seconds > self.sim.tbt_slo_s) if slow is None else slow
            self.slow_total.append((self.slow_total[-1] if self.slow_total else 0) + slow)

    def _admit_joins(self) -> None:
        while self.joining:
            if self.max_batch and len(self.batch) >= self.max_batch:
                return  # BS_max reached: wait for a sequence to finish
            request = self.joining[0].request
            if self.batch.heap and self.reserved + request.input_len + request.output_len > self.capacity_tokens:
                return  # wait for finishes to free KV (admission already checked what it could)
            record = self.joining.popleft()
            self.reserved += request.input_len + request.output_len
            self.batch.add(record, request.input_len + 1, request.output_len - 1)

    def _next(self, now: float) -> None:
        self._admit_joins()
        if self.waiting and self._prefill_fits():
            if self.chunk_tokens:
                self._mixed_step(now)
            else:
                self._prefill_step(now)
            return
        if len(self.batch):
            self.stepping = True
            self._schedule_segment(now, self.batch.steps_to_next_finish())
            return
        self.stepping = False

    def _prefill_fits(self) -> bool:
        request = self.waiting[0].request
        return self.reserved + request.input_len + request.output_len <= self.capacity_tokens or not self.batch.heap

    def _begin_prefill(self, record: Record, now: float) -> int:
        if record.prefill_start < 0:
            cached_blocks, _ = self.sim.reuse_prefix(self, record, now)
            record.prefill_start = now
            self.prefill_done_tokens = self.sim.estimator.cached_tokens(record.request.input_len, cached_blocks)
            self.prefill_compute_s = 0.0
        return record.request.input_len - self.prefill_done_tokens

    def _prefill_step(self, now: float) -> None:
        """vLLM without chunking: the whole prompt in one step; the decode batch waits."""
        record = self.waiting[0]
        todo = self._begin_prefill(record, now)
        seconds = self.sim.prefill_seconds(record, None, todo, self.prefill_done_tokens)
        self.prefill_compute_s += seconds
        self.prefill_done_tokens += todo
        self.stepping = True
        self.sim.at(now + seconds, self._prefill_step_end, seconds)

    def _mixed_step(self, now: float) -> None:
        """Chunked prefill: one step carries every decode sequence plus up to the budget of prompt tokens."""
        record = self.waiting[0]
        todo = self._begin_prefill(record, now)
        budget = self.chunk_tokens - len(self.batch)
        chunk = min(todo, max(budget, self.chunk_tokens // 8))
        seconds = self.sim.prefill_seconds(record, None, chunk, self.prefill_done_tokens)
        self.prefill_compute_s += seconds
        if len(self.batch):
            seconds += self.batch.first_step_s() - self.sim.cost.prefill[0]  # one pass reads the weights once
        self.prefill_done_tokens += chunk
        self.stepping = True
        self.sim.at(now + seconds, self._mixed_step_end, seconds)

    def _prefill_step_end(self, now: float, stall_s: float) -> None:
        if len(self.batch):  # the running sequences' next token comes one step after the stall
            self._note_gap(now, stall_s + self.batch.first_step_s())
        self._prefill_progress(now)
        self._next(now)
        self.sim.report_batch(self, now)

    def _mixed_step_end(self, now: float, step_s: float) -> None:
        self._note_gap(now, step_s)
        if len(self.batch):
            self._retire(self.batch.advance(1), now)
        self._prefill_progress(now)
        self._next(now)
        self.sim.report_batch(self, now)

    def _prefill_progress(self, now: float) -> None:
        record = self.waiting[0]
        if self.prefill_done_tokens < record.request.input_len:
            return
        self.waiting.popleft()
        self.sim.store_blocks(self, record.request.hashes)
        if self.sim.prefill_done(record, now, self.prefill_compute_s, local=True):
            self.joining.append(record)

    # ---------------------------------------------------------------- reports

    def queue_s(self, now: float) -> float:
        return sum(r.predicted_prefill_s for r in self.waiting)

    def step_s(self, now: float) -> float:
        return self.batch.cost.t_decode(len(self.batch), self.kv_now(now)) if len(self.batch) else 0.0

    def load_reports(self, now: float, block: int) -> list[LoadReport]:
        total = int(self.capacity_tokens // block) if self.capacity_tokens != float("inf") else 0
        used = min(total, -(-self.kv_now(now) // block)) if total else 0
        decode = LoadReport(instance_id=self.instance_id, role="decode", cluster=self.cluster, kv_addr=self.instance_id,
                            queued_requests=0, queued_tokens=0, running=self.batch_size(), kv_blocks_total=total,
                            kv_blocks_free=total - used, ts=now, cost=self.announce)
        self.announce = None
        if not self.colocated:
            return [decode]
        queued = sum(r.request.input_len for r in self.waiting)
        prefill = LoadReport(instance_id=self.instance_id, role="prefill", cluster=self.cluster,
                             kv_addr=self.instance_id, queued_requests=len(self.waiting), queued_tokens=queued,
                             running=0, kv_blocks_total=0, kv_blocks_free=0, ts=now, est_queue_s=self.queue_s(now))
        return [prefill, decode]


def _slow_steps(first_s: float, growth_s: float, steps: int, slo_s: float) -> int:
    """How many of `steps` steps lasting first_s + growth_s * j (j = 0, 1, ...) exceed slo_s."""
    if first_s > slo_s:
        return steps
    if growth_s <= 0:
        return 0
    within = int((slo_s - first_s) // growth_s) + 1
    return max(0, steps - within)
