"""No head-of-line blocking on the KV path (issue 19): with one of two decode instances stopped (SIGSTOP)
while KV is pushed to it, a request through the same prefill to the other decode is answered at once; the
push to the stopped one is given up on after its deadline and only that request fails."""

from __future__ import annotations

import os
import signal
import time

import nats

from harness import UpProcess
from waiting import eventually_async
from kvcentric.core.protocol import (DecodeJob, PrefillJob, SamplingParams, SubmitAck, Subjects, TokenChunk, decode,
                                     encode)
from kvcentric.runtime.transfer import DRAIN_FLOOR_S


async def submit(nc, role: str, instance: str, job) -> None:
    reply = await nc.request(Subjects.submit(role, instance), encode(job), timeout=10)
    ack = decode(reply.data, SubmitAck)
    assert ack.ok, ack.error


SAMPLING = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


async def send_decode_job(nc, request_id: str, decode_id: str, prompt: list[int]):
    """The request's decode job, as the conductor sends it; returns the request's output subscription."""
    outputs = await nc.subscribe(Subjects.out(request_id))
    await submit(nc, "decode", decode_id, DecodeJob(request_id=request_id, n_prompt_tokens=len(prompt),
                                                     sampling=SAMPLING))
    return outputs


async def send_prefill_job(nc, up: UpProcess, request_id: str, decode_id: str, prompt: list[int]) -> None:
    kv_addr = up.health(decode_id)["kv_addr"]
    await submit(nc, "prefill", "prefill-0", PrefillJob(request_id=request_id, token_ids=prompt, sampling=SAMPLING,
                                                        decode_id=decode_id, decode_kv_addr=kv_addr))


async def test_a_stopped_decode_does_not_delay_requests_to_another(tmp_path):
    up = UpProcess(str(tmp_path), "--model", "tiny", "--decode", "2")
    stopped = up.manifest["services"]["decode-0"]["pid"]
    nc = await nats.connect(up.manifest["nats_url"])
    try:
        stuck_prompt, healthy_prompt = [256] + list(range(200)), [256] + list(range(100, 160))
        decode_0_addr = up.health("decode-0")["kv_addr"]
        stuck = await send_decode_job(nc, "to-stopped", "decode-0", stuck_prompt)
        os.kill(stopped, signal.SIGSTOP)  # its job is in; its KV will not be read
        started = time.monotonic()
        await submit(nc, "prefill", "prefill-0", PrefillJob(request_id="to-stopped", token_ids=stuck_prompt,
                                                            sampling=SAMPLING, decode_id="decode-0",
                                                            decode_kv_addr=decode_0_addr))
        # the prefill computes it, and its push waits on the stopped receiver
        await eventually_async(lambda: up.health("prefill-0")["stats"], "the prefill computed the stuck prompt",
                               until=lambda stats: stats["prefill_tokens_computed"] >= len(stuck_prompt),
                               every_s=0.05)
        healthy = await send_decode_job(nc, "to-healthy", "decode-1", healthy_prompt)
        await send_prefill_job(nc, up, "to-healthy", "decode-1", healthy_prompt)
        chunks = []
        while not (chunks and chunks[-1].finish_reason):
            chunks.append(decode((await healthy.next_msg(timeout=60)).data, TokenChunk))
        answered = time.monotonic() - started
        assert chunks[-1].finish_reason == "length" and not chunks[-1].error
        assert answered < DRAIN_FLOOR_S  # before the stopped push could even be given up on
        failed = decode((await stuck.next_msg(timeout=60)).data, TokenChunk)
        assert failed.finish_reason == "error" and "not taken within" in failed.error
        assert time.monotonic() - started >= DRAIN_FLOOR_S
        await eventually_async(lambda: up.health("prefill-0")["stats"], "the given-up request's blocks released",
                               until=lambda stats: stats["kv_blocks_free"] == stats["kv_blocks_total"], every_s=0.1)
    finally:
        os.kill(stopped, signal.SIGCONT)
        await nc.close()
        up.stop()
