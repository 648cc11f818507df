"""Factories shared by the tests: small runners, pools, engines and requests."""

from __future__ import annotations

import itertools

from kvcentric.engine.block_pool import BlockPool
from kvcentric.engine.runner import ModelRunner
from kvcentric.model.config import preset
from kvcentric.protocol import DecodeJob, LoadReport, PrefillJob, SamplingParams

_ids = itertools.count()


def make_runner(num_blocks: int = 64, block_size: int = 4, seed: int = 0, model: str = "tiny") -> ModelRunner:
    return ModelRunner(preset(model), num_blocks, block_size, seed)


def make_pool(runner: ModelRunner) -> BlockPool:
    return BlockPool(runner.k_cache.shape[1] // runner.block_size, runner.block_size)


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(n: int, offset: int = 0) -> list[int]:
    return [256] + [(offset + 7 * i) % 256 for i in range(n - 1)]


def prefill_job(token_ids: list[int], params: SamplingParams | None = None, request_id: str | None = None) -> PrefillJob:
    return PrefillJob(request_id or f"req-{next(_ids)}", token_ids, params or greedy(), "decode-0", "127.0.0.1:1")


def decode_job(request_id: str, n_prompt: int, params: SamplingParams | None = None, wait_s: float = 30.0) -> DecodeJob:
    return DecodeJob(request_id, n_prompt, params or greedy(), wait_s)


def load_report(instance_id: str, role: str, queued_tokens: int = 0, running: int = 0, ts: float = 0.0) -> LoadReport:
    return LoadReport(instance_id, role, "local", f"127.0.0.1:{5000 + hash(instance_id) % 1000}", 0, queued_tokens,
                      running, 100, 100, ts)
