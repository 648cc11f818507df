"""What handing a placed request to its engines means: the jobs a placement implies, and whether the
dispatch part of a schedule request is sound. It sends nothing; `kvcentric.runtime.dispatch` does.
"""

from __future__ import annotations

from kvcentric.core.protocol import (DecodeJob, Placement, PrefillJob, SamplingParams, ScheduleRequest,
                                     job_problem)

Submit = tuple[str, str, PrefillJob | DecodeJob]
"""(role, instance id, job)."""

KV_WAIT_FLOOR_S = 30.0
"""The least a decode instance waits for a placed request's KV (DecodeJob's default)."""


def kv_wait_s(predicted_ttft_s: float) -> float:
    """How long the decode instance waits for the KV: three times the predicted TTFT, at least 30 s (the
    decode instance caps it with its --kv-wait-s). A prefill that dies is found by liveness (and the
    request migrated) long before; this bound is for KV that is merely late, and an admitted request's KV
    is not late until well past its prediction."""
    return max(KV_WAIT_FLOOR_S, 3 * predicted_ttft_s)


def jobs(request_id: str, placement: Placement, token_ids: list[int], sampling: SamplingParams) -> list[Submit]:
    """The prefill job, and the decode job unless one colocated instance does both (it takes its decode
    job from the prefill job)."""
    prefill = PrefillJob(request_id=request_id, token_ids=token_ids, sampling=sampling, decode_id=placement.decode_id,
                         decode_kv_addr=placement.decode_kv_addr, kv_source_addr=placement.kv_source_addr,
                         pull_block_hashes=placement.pull_block_hashes,
                         kv_skip_tokens=placement.decode_prefix_tokens if placement.decode_prefix_addr else 0,
                         cached_tokens=placement.cached_tokens, pipeline_addrs=placement.pipeline_addrs)
    submits: list[Submit] = [("prefill", placement.prefill_id, prefill)]
    if placement.decode_id != placement.prefill_id:
        decode = DecodeJob(request_id=request_id, n_prompt_tokens=len(token_ids), sampling=sampling,
                           kv_wait_s=kv_wait_s(placement.predicted_ttft_s),
                           prefix_source_addr=placement.decode_prefix_addr,
                           prefix_block_hashes=placement.decode_prefix_hashes,
                           prefix_tokens=placement.decode_prefix_tokens if placement.decode_prefix_addr else 0,
                           tbt_check=placement.decode_tbt_check)
        submits.append(("decode", placement.decode_id, decode))
    return submits


def bad_dispatch(request: ScheduleRequest) -> str:
    """Why a request's dispatch part is bad or does not fit the rest of it, or "" (the engines check the
    token ids against their vocabulary)."""
    job = request.dispatch
    if job is None:
        return ""
    problem = job_problem(request.request_id, job.sampling)
    if problem:
        return problem
    if len(job.token_ids) != request.n_tokens:
        return f"dispatch.token_ids has {len(job.token_ids)} tokens, n_tokens says {request.n_tokens}"
    if job.sampling.max_tokens != request.max_tokens:
        return f"dispatch.sampling.max_tokens is {job.sampling.max_tokens}, max_tokens says {request.max_tokens}"
    return ""
