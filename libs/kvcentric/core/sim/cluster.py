"""The discrete-event cluster: P prefill + D decode instances, or N colocated ones, replaying a workload
through the live Conductor core (`kvcentric.core.scheduling.conductor.Conductor`) on a virtual clock. With a
`ClusterSetup` (PrfaaS) it adds a PrfaaS cluster of prefill instances joined to the PD cluster by a
bandwidth-limited link, and the conductor routes between them as it does live.

It plays the parts the live system's services play around the core: it turns arrivals into
ScheduleRequests with the prefix hits of an in-memory block index (kvs-meta's role), sends load reports
when an instance's state changes, executes placements on the simulated instances, and feeds outcomes
back. It does not decide placement or rejection itself, except the decode instance's own TBT
double-check on KV arrival (Mooncake §3 step 4).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import time
from collections.abc import Callable, Mapping

import msgspec

from kvcentric.core.costmodel import CostModel, decode_tbt_check
from kvcentric.core.protocol import LoadReport, Rejection, RequestOutcome, ScheduleRequest
from kvcentric.core.scheduling.clusters import ClusterSetup
from kvcentric.core.scheduling.conductor import Conductor
from kvcentric.core.scheduling.config import SchedulerConfig
from kvcentric.core.scheduling.estimators import LinkTable
from kvcentric.core.scheduling.eviction import BlockCache
from kvcentric.core.scheduling.groups import PipelinedCost
from kvcentric.core.scheduling.prefix import PrefixIndex
from kvcentric.core.sim.instances import BatchInstance, PrefillInstance
from kvcentric.core.sim.metrics import LoadSeries, Record
from kvcentric.core.sim.workload import SimRequest


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """The simulated hardware and layout (what the CLI derives from presets and flags)."""

    architecture: str = "disaggregated"
    prefill: int = 8
    decode: int = 8
    instances: int = 16
    """Colocated instances (architecture colocated)."""
    chunk_tokens: int = 0
    """Colocated: token budget of a chunked-prefill step (0: whole prompts, the batch waits)."""
    cache_blocks: float = math.inf
    """Prefix-cache capacity of each instance's host memory, in blocks."""
    eviction: str = "lru"
    decode_capacity_tokens: float = math.inf
    link_bytes_per_s: float = 100e9
    num_layers: int = 80
    """KV streams layer by layer: decode has it all one layer's transfer after prefill ends."""
    noise: float = 0.0
    """Execution times are multiplied by a lognormal factor of this sigma (0: exactly the cost model)."""
    seed: int = 0
    prfaas: int = 0
    """Prefill instances of the PrfaaS cluster (with a `ClusterSetup`; `prefill` is then the PD cluster's)."""
    decode_max_batch: int = 0
    """Most sequences a decode instance runs at once, BS_max (0: no limit but its KV capacity)."""
    prefill_pipeline: int = 1
    """Nodes of each prefill instance: with X > 1 a pipelined prefill group of X nodes, each holding 1/X of
    the layers (Mooncake §5.1), reporting to the conductor as X stages."""
    prefill_chunk: int = 512
    """Tokens per chunk of a prefill group's pipeline."""


class Simulation:
    def __init__(self, scheduler: SchedulerConfig, cost: CostModel, spec: ClusterSpec,
                 clusters: ClusterSetup | None = None, pool_costs: Mapping[str, CostModel] | None = None) -> None:
        """`pool_costs`: the cost model of the "prefill" or "decode" pool where it is not `cost` (a mixed
        fleet); those instances run by it and announce it in their load reports, as live engines announce
        what they measured, so the conductor predicts each with its own."""
        self.scheduler, self.cost, self.spec, self.clusters = scheduler, cost, spec, clusters
        self.pool_costs = dict(pool_costs or {})
        self.conductor = Conductor(scheduler, cost, stale_after_s=math.inf, clusters=clusters)
        self.conductor.links.default = spec.link_bytes_per_s
        self.estimator = self.conductor.estimator
        self.tbt_slo_s = scheduler.tbt_slo_s
        self.links = LinkTable(spec.link_bytes_per_s)
        """The real links (the conductor keeps its own estimate)."""
        self.cross_links = LinkTable(spec.link_bytes_per_s)
        """The real inter-cluster links (PrfaaS), keyed by cluster."""
        self.index = PrefixIndex()
        self.rng = random.Random(spec.seed)
        self.now = 0.0
        self.events: list = []
        self._seq = 0
        self.prefills: dict[str, PrefillInstance | BatchInstance] = {}
        self.decodes: dict[str, BatchInstance] = {}
        self.series = LoadSeries()
        self.accepted = self.rejected = 0
        self.records: list[Record] = []
        self.stage_aliases: dict[str, str] = {}
        """Later stages of simulated prefill groups -> their first stage (they hold what it holds)."""
        self._build()

    def _build(self) -> None:
        spec = self.spec
        if spec.architecture == "colocated":
            for i in range(spec.instances):
                instance = BatchInstance(self, f"c{i}", spec.decode_capacity_tokens, colocated=True,
                                         cache=BlockCache(spec.cache_blocks, spec.eviction),
                                         chunk_tokens=spec.chunk_tokens)
                self.prefills[instance.instance_id] = self.decodes[instance.instance_id] = instance
        else:
            local = self.clusters.local if self.clusters else "sim"
            for i in range(spec.prefill):
                if spec.prefill_pipeline > 1:
                    self._build_group(f"p{i}", local)
                    continue
                self.prefills[f"p{i}"] = PrefillInstance(self, f"p{i}", BlockCache(spec.cache_blocks, spec.eviction),
                                                         local, self.pool_costs.get("prefill"))
            self._build_prfaas()
            for i in range(spec.decode):
                self.decodes[f"d{i}"] = BatchInstance(self, f"d{i}", spec.decode_capacity_tokens, cluster=local,
                                                      max_batch=spec.decode_max_batch,
                                                      cost=self.pool_costs.get("decode"))
        for prefill in self.prefills.values():
            self.index.slot(prefill.instance_id)
            self.report_instance(prefill, 0.0)
        for decode in self.decodes.values():
            self.report_batch(decode, 0.0)

    def _build_group(self, group: str, cluster: str) -> None:
        """A prefill group: one instance (its first stage's id) computing at the pipelined cost of X nodes;
        its later stages only report (their queues follow the first's), so the conductor sees X stages."""
        stages, base = self.spec.prefill_pipeline, self.pool_costs.get("prefill", self.cost)
        cost = PipelinedCost(base.prefill, base.decode, base.kv_bytes_per_token, f"pipeline:{stages}",
                             base.kv_bytes_fixed, stage_costs=(base,) * stages, share=1.0 / stages,
                             chunk=self.spec.prefill_chunk)
        head = PrefillInstance(self, f"{group}-s0", BlockCache(self.spec.cache_blocks, self.spec.eviction), cluster,
                               cost)
        head.announce, head.pipeline = None, (group, stages)
        self.prefills[head.instance_id] = head
        for stage in range(1, stages):
            self.stage_aliases[f"{group}-s{stage}"] = head.instance_id
            name = f"{group}-s{stage}"
            self.report(msgspec.structs.replace(head.load_report(0.0), instance_id=name, kv_addr=name, stage=stage),
                        0.0)

    def _build_prfaas(self) -> None:
        """PrfaaS prefill instances r0.. in the first PrfaaS cluster, on that cluster's cost model."""
        if not self.clusters or not self.spec.prfaas:
            return
        name = self.clusters.prfaas[0]
        cost = self.clusters.costs.get(name, self.cost)
        for i in range(self.spec.prfaas):
            cache = BlockCache(self.spec.cache_blocks, self.spec.eviction)
            self.prefills[f"r{i}"] = PrefillInstance(self, f"r{i}", cache, name, cost, remote=True)

    # ---------------------------------------------------------------- event loop

    def at(self, when: float, action: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self.events, (when, self._seq, action, args))

    def run(self, requests: list[SimRequest], sample_s: float = 1.0, progress=None) -> list[Record]:
        self.records = [Record(r) for r in requests]
        for record in self.records:
            self.at(record.request.arrival_s, self.arrive, record)
        end = max((r.arrival_s for r in requests), default=0.0)
        if sample_s > 0:
            self.at(0.0, self.sample, sample_s, end)
        events, pop = self.events, heapq.heappop
        while events:
            when, _, action, args = pop(events)
            self.now = when
            action(when, *args)
            if progress is not None:
                progress.tick(self)
        return self.records

    def sample(self, now: float, every_s: float, end: float) -> None:
        slo = self.scheduler
        prefill = [i.queue_s(now) / slo.ttft_slo_s for i in self.prefills.values()]
        decode = [i.step_s(now) / slo.tbt_slo_s for i in self.decodes.values()]
        series = self.series
        series.t.append(now)
        series.prefill.append(sum(prefill) / len(prefill))
        series.decode.append(sum(decode) / len(decode))
        series.accepted.append(self.accepted)
        series.rejected.append(self.rejected)
        self.accepted = self.rejected = 0
        if now < end or any(len(i.batch) for i in self.decodes.values()):
            self.at(now + every_s, self.sample, every_s, end)

    # ---------------------------------------------------------------- conductor side

    def arrive(self, now: float, record: Record) -> None:
        request = record.request
        hits = self.index.match(request.hashes)
        if self.stage_aliases:
            hits = {**hits, **{stage: hits.get(head, 0) for stage, head in self.stage_aliases.items()}}
        ask = ScheduleRequest(request_id=request.request_id, n_tokens=request.input_len, block_hashes=request.hashes,
                              max_tokens=request.output_len, priority=request.priority)
        decision = self.conductor.schedule(ask, hits, now)
        if isinstance(decision, Rejection):
            record.status, record.reason = "rejected_before_prefill", decision.stage or decision.reason
            self.rejected += 1
            return
        self.accepted += 1
        record.prefill_id, record.decode_id = decision.prefill_id, decision.decode_id
        record.predicted_ttft_s = decision.predicted_ttft_s
        record.planned_blocks = hits.get(decision.prefill_id, 0) + len(decision.pull_block_hashes)
        record.pull_source = decision.kv_source_id
        record.predicted_prefill_s = self.estimator.t_prefill(request.input_len, record.planned_blocks)
        target = self.prefills[decision.prefill_id]
        if isinstance(target, PrefillInstance):
            target.submit(record, now)
        else:
            target.submit_prefill(record, now)

    def report(self, report: LoadReport, now: float) -> None:
        self.conductor.observe(report, now)

    def report_instance(self, instance, now: float) -> None:
        if isinstance(instance, PrefillInstance):
            self.report(instance.load_report(now), now)
        else:
            self.report_batch(instance, now)

    def report_batch(self, instance: BatchInstance, now: float) -> None:
        for report in instance.load_reports(now, self.estimator.block_tokens):
            self.conductor.observe(report, now)

    # ---------------------------------------------------------------- instance side

    def reuse_prefix(self, instance, record: Record, now: float) -> tuple[int, float]:
        """At prefill start: the blocks held locally, plus those pulled from the named source that it
        still holds. Returns (leading blocks reused, when the pulled ones have arrived)."""
        hashes = record.request.hashes
        local = instance.cache.prefix_len(hashes)
        instance.cache.touch(hashes[:local])
        ready_at, pulled = now, 0
        source = self.prefills.get(record.pull_source)
        if source is not None and record.planned_blocks > local:
            source_cache = source.cache
            assert source_cache is not None  # every instance that prefills keeps a prefix cache
            available = source_cache.prefix_len(hashes[:record.planned_blocks])
            pulled = max(0, available - local)
            if pulled:
                source_cache.touch(hashes[local:available])
                nbytes = self.estimator.block_bytes(pulled)
                ready_at = self.links.reserve(source.instance_id, instance.instance_id, nbytes, now)
        record.cached_blocks, record.pulled_blocks = local + pulled, pulled
        return local + pulled, ready_at

    def prefill_seconds(self, record: Record, cached_blocks: int | None, n_new: int | None = None,
                        n_cached: int | None = None, cost: CostModel | None = None) -> float:
        if n_new is None:
            assert cached_blocks is not None  # without the token counts, the cached blocks give them
            n_cached = self.estimator.cached_tokens(record.request.input_len, cached_blocks)
            n_new = record.request.input_len - n_cached
        assert n_cached is not None  # given with n_new, or counted above
        seconds = (cost or self.cost).t_prefill(n_new, n_cached)
        if self.spec.noise:
            seconds *= self.rng.lognormvariate(0.0, self.spec.noise)
        return seconds

    def store_blocks(self, instance, hashes: list[str]) -> None:
        cache = instance.cache
        missing = [h for h in hashes if h not in cache]
        evicted = cache.insert(hashes)
        self.index.add(instance.instance_id, missing)
        if evicted:
            self.index.remove(instance.instance_id, evicted)

    def prefill_done(self, record: Record, now: float, compute_s: float, local: bool = False,
                     sender: PrefillInstance | None = None) -> bool:
        """First token out (the conductor hears of it, as from a gateway). Returns whether the request goes on
        decoding (output longer than one token)."""
        record.first_token = now
        self.conductor.on_first_token(self.outcome(record, now), now)
        if record.request.output_len <= 1:
            record.finish = now
            self.finished(record, now)
            return False
        if not local:
            if sender is not None and sender.remote:
                arrival = self._cross_link(sender, record, now)
            else:
                nbytes = self.cost.kv_bytes(record.request.input_len)
                transfer_s = nbytes / self.spec.link_bytes_per_s
                arrival = max(now, record.prefill_start + transfer_s) + transfer_s / self.spec.num_layers
            self.at(arrival, self.decodes[record.decode_id].kv_arrived, record)
        return True

    def _cross_link(self, sender: PrefillInstance, record: Record, now: float) -> float:
        """A PrfaaS prefill's KV over the inter-cluster link, shared FIFO by the cluster's instances: it
        streams from prefill start, and the last layer leaves only when the prefill ends (PrfaaS §3.3)."""
        clusters = self.clusters
        assert clusters is not None  # a remote sender is in a PrfaaS cluster of the topology
        nbytes = sender.cost.kv_bytes(record.request.input_len)
        sender.kv_bytes_sent += nbytes
        bandwidth = clusters.link_bytes_per_s(sender.cluster, clusters.local)
        self.cross_links.set_bandwidth(sender.cluster, clusters.local, bandwidth)
        done = self.cross_links.reserve(sender.cluster, clusters.local, nbytes, record.prefill_start)
        return max(done, now + nbytes / bandwidth / self.spec.num_layers)

    def decode_accepts(self, instance: BatchInstance, record: Record, now: float) -> bool:
        """The decode instance's own check when the KV arrives: TBT SLO and KV capacity."""
        if self.scheduler.rejection == "never":
            return True
        request = record.request
        if instance.reserved + request.input_len + request.output_len > instance.capacity_tokens:
            record.reason = "decode_kv_full"
            return False
        kv = instance.kv_now(now) + sum(r.request.input_len + 1 for r in instance.joining)
        verdict = decode_tbt_check(instance.batch.cost, instance.batch_size(), kv, request.input_len + 1,
                                   self.scheduler.tbt_slo_s)
        if not verdict.accepted:
            record.reason = "decode_tbt"
        return verdict.accepted

    def rejected_after_prefill(self, record: Record, now: float) -> None:
        record.status = "rejected_after_prefill"
        self.conductor.forget(record.request.request_id)

    def finished(self, record: Record, now: float) -> None:
        record.status = "completed"
        self.conductor.on_outcome(self.outcome(record, now, finish_reason="length"), now)

    def outcome(self, record: Record, now: float, finish_reason: str = "") -> RequestOutcome:
        """What a gateway tells the conductor of a request: at its first token, and again at its end."""
        request = record.request
        return RequestOutcome(request_id=request.request_id, prefill_id=record.prefill_id,
                              decode_id=record.decode_id, finish_reason=finish_reason, ttft_s=record.ttft_s,
                              e2e_s=now - request.arrival_s, prompt_tokens=request.input_len,
                              completion_tokens=request.output_len, predicted_ttft_s=record.predicted_ttft_s)


class Progress:
    """A one-line progress report on stderr, at most every `every_s` of wall time."""

    def __init__(self, total: int, stream, every_s: float = 1.0) -> None:
        self.total, self.stream, self.every_s = total, stream, every_s
        self.started = self.last = time.monotonic()
        self.count = 0

    def tick(self, sim: Simulation) -> None:
        self.count += 1
        if self.count & 1023:
            return
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            done = sum(r.status != "pending" for r in sim.records)
            self.stream.write(f"\rsim: {done}/{self.total} requests done, simulated {sim.now:,.0f} s, "
                              f"{now - self.started:.0f} s elapsed ")
            self.stream.flush()

    def close(self) -> None:
        self.stream.write(f"\rsim: done in {time.monotonic() - self.started:.1f} s" + " " * 40 + "\n")
        self.stream.flush()
