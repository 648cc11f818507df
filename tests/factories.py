"""Factories shared by the tests: small runners, pools, engines and requests."""

from __future__ import annotations

import itertools
import os
import zlib
from typing import TYPE_CHECKING

from kvcentric.core.block_pool import BlockPool
from kvcentric.model.config import preset
from kvcentric.core.protocol import DecodeJob, LoadReport, PrefillJob, SamplingParams

if TYPE_CHECKING:  # the runner imports torch: a pure-core test that takes only requests and reports needs none
    from kvcentric.engine.model.runner import ModelRunner

_ids = itertools.count()

# The engine tests run on the CPU; KVC_TEST_DEVICE=cuda runs the same tests through the CUDA paths (side streams,
# events, pinned copies) on a GPU machine (bench/gpu_check.sh).
TEST_DEVICE = os.environ.get("KVC_TEST_DEVICE", "cpu")


def make_runner(num_blocks: int = 64, block_size: int = 4, seed: int = 0, model: str = "tiny",
                device: str = TEST_DEVICE) -> ModelRunner:
    from kvcentric.engine.model.runner import ModelRunner
    return ModelRunner(preset(model), num_blocks, block_size, seed, device=device)


def make_pool(runner: ModelRunner) -> BlockPool:
    return BlockPool(runner.num_blocks, runner.block_size)


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [256] + [(offset + 7 * i) % 256 for i in range(n - 1)]


def prefill_job(token_ids: list[int], params: SamplingParams | None = None,
                request_id: str | None = None) -> PrefillJob:
    return PrefillJob(request_id=request_id or f"req-{next(_ids)}", token_ids=token_ids, sampling=params or greedy(),
                      decode_id="decode-0", decode_kv_addr="127.0.0.1:1")


def decode_job(request_id: str, n_prompt: int, params: SamplingParams | None = None, wait_s: float = 30.0) -> DecodeJob:
    return DecodeJob(request_id=request_id, n_prompt_tokens=n_prompt, sampling=params or greedy(), kv_wait_s=wait_s)


def colocated_with_prompts(params: SamplingParams, sizes: tuple[int, ...] = (7, 19, 12)):
    """A colocated engine (`tiny`, 4-token blocks, 6-token chunks) with a request c0, c1, ... submitted per prompt size,
    and each prompt's tokens as one engine alone generates them."""
    from kvcentric.core.hashing import BlockHasher
    from kvcentric.engine.cores.colocated import ColocatedEngine
    from kvcentric.engine.model.local import generate
    prompts = [prompt(n, offset=n) for n in sizes]
    runner = make_runner(block_size=4)
    expected = [generate(runner, make_pool(runner), p, params)[0] for p in prompts]
    engine = ColocatedEngine(make_runner(block_size=4), make_pool(runner), BlockHasher(block_size=4), chunk_tokens=6)
    for i, p in enumerate(prompts):
        job = prefill_job(p, params, request_id=f"c{i}")
        engine.submit(job, decode_job(job.request_id, len(p), params))
    return engine, expected


def load_report(instance_id: str, role: str, queued_tokens: int = 0, running: int = 0, ts: float = 0.0) -> LoadReport:
    port = 5000 + zlib.crc32(instance_id.encode()) % 1000  # the same in every run (str hashes are salted)
    return LoadReport(instance_id=instance_id, role=role, cluster="local", kv_addr=f"127.0.0.1:{port}",
                      queued_requests=0, queued_tokens=queued_tokens, running=running, kv_blocks_total=100,
                      kv_blocks_free=100, ts=ts)


# ---------------------------------------------------------------- conductor clusters (scheduling tests)

def simple_cost():
    """1 s per 1000 new tokens (no fixed or attention cost); decode steps of 10 ms + 1 ms per sequence."""
    from kvcentric.core.costmodel import CostModel
    return CostModel((0.0, 1e-3, 0.0, 0.0), (0.01, 1e-3, 0.0), 1000, "test")


def make_conductor(prefills=2, decodes=2, now=0.0, cost=None, **settings):
    """A Conductor on a hand-built cluster of idle instances p0.. and d0.. (blocks of 100 tokens)."""
    from kvcentric.core.scheduling.conductor import Conductor
    from kvcentric.core.scheduling.config import SchedulerConfig
    settings.setdefault("block_size", 100)
    settings.setdefault("expect_cache", False)  # requests here share their hashes h0, h1, ... without sharing text
    conductor = Conductor(SchedulerConfig(**settings), cost or simple_cost(), stale_after_s=1.0)
    for i in range(prefills):
        conductor.observe(prefill_report(f"p{i}"), now)
    for i in range(decodes):
        conductor.observe(decode_report(f"d{i}"), now)
    return conductor


def prefill_report(instance_id: str, queue_s: float = 0.0, queued_tokens: int = 0, cluster: str = "local",
                   kv_bytes_sent: int = 0) -> LoadReport:
    return LoadReport(instance_id=instance_id, role="prefill", cluster=cluster, kv_addr=f"{instance_id}:7000",
                      queued_requests=0, queued_tokens=queued_tokens, running=0, kv_blocks_total=0, kv_blocks_free=0,
                      ts=0.0, est_queue_s=queue_s, kv_bytes_sent=kv_bytes_sent)


def decode_report(instance_id: str, running: int = 0, used_blocks: int = 0, total_blocks: int = 1000,
                  cluster: str = "local") -> LoadReport:
    return LoadReport(instance_id=instance_id, role="decode", cluster=cluster, kv_addr=f"{instance_id}:7000",
                      queued_requests=0, queued_tokens=0, running=running, kv_blocks_total=total_blocks,
                      kv_blocks_free=total_blocks - used_blocks, ts=0.0)


def prefill_view(instance_id: str, queue_s: float = 0.0, prefix: int = 0, held: int | None = None,
                 cluster: str = "local", correction: float = 1.0, load_tokens: int = 0, trusted: bool = True):
    """What a placement policy sees of a prefill instance: `prefix` blocks of the prompt held (`held` of them held
    now, the rest expected; all of them unless given), its own model the prior's."""
    from kvcentric.core.scheduling.view import PrefillView
    report = prefill_report(instance_id, queue_s, cluster=cluster)
    return PrefillView(instance_id, report.kv_addr, cluster, report, queue_s, load_tokens, 0, None, trusted, correction,
                       prefix, prefix if held is None else held)


def schedule_request(n_tokens: int = 1000, request_id: str = "r", priority: int = 0, blocks: int | None = None,
                     max_tokens: int = 16):
    """A request of n_tokens whose block hashes are h0, h1, ... (one per 100 tokens unless `blocks`)."""
    from kvcentric.core.protocol import ScheduleRequest
    count = blocks if blocks is not None else -(-n_tokens // 100)
    return ScheduleRequest(request_id=request_id, n_tokens=n_tokens, block_hashes=[f"h{i}" for i in range(count)],
                           max_tokens=max_tokens, priority=priority)


def two_cluster_setup(threshold: float = 1000, gbps: float = 8.0, adjust_s: float = 0.0, costs=None, **short_term):
    """PrfaaS topology: PD cluster "pd" and PrfaaS cluster "prfaas" joined by a `gbps` link (8 Gbit/s = 1 GB/s)."""
    from kvcentric.core.prfaas.routing import ShortTermPolicy
    from kvcentric.core.prfaas.topology import Topology
    from kvcentric.core.scheduling.clusters import ClusterSetup
    topology = Topology.from_dict({"clusters": [{"name": "pd", "role": "pd", "instances": 3},
                                                {"name": "prfaas", "role": "prfaas", "instances": 1}],
                                   "links": [{"between": ["prfaas", "pd"], "gbps": gbps}]})
    return ClusterSetup(topology, "pd", threshold, adjust_s, ShortTermPolicy(**short_term), costs or {})


def make_two_cluster_conductor(pd_prefills=1, prfaas_prefills=1, decodes=1, now=0.0, setup=None, **settings):
    """A Conductor routing across clusters: prefills a0.. in "pd", r0.. in "prfaas", decodes d0.. in "pd"."""
    from kvcentric.core.scheduling.conductor import Conductor
    from kvcentric.core.scheduling.config import SchedulerConfig
    settings.setdefault("block_size", 100)
    settings.setdefault("expect_cache", False)  # requests here share their hashes h0, h1, ... without sharing text
    conductor = Conductor(SchedulerConfig(**settings), simple_cost(), stale_after_s=1.0,
                          clusters=setup or two_cluster_setup())
    for i in range(pd_prefills):
        conductor.observe(prefill_report(f"a{i}", cluster="pd"), now)
    for i in range(prfaas_prefills):
        conductor.observe(prefill_report(f"r{i}", cluster="prfaas"), now)
    for i in range(decodes):
        conductor.observe(decode_report(f"d{i}", cluster="pd"), now)
    return conductor
