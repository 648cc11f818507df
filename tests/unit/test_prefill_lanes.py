"""A prefill instance's second model thread (`node.Lane`, `ModelThread.lane_call`, `PrefillEngine.computing`):
prompts computed in passes on both threads at once get the first token and the KV that computing each alone
gives; the scheduler never hands out a prompt the other thread computes; the instance counts as computing
until both threads' calls end; and the lane waits at its looks while no core is lent to it and the model
thread computes, going on once either changes; on a colocated instance's own cores (no share) the lane takes
one of the model thread's threads while it computes."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from factories import make_pool, make_runner, prompt
from kvcentric.core.hashing import BlockHasher
from kvcentric.core.protocol import PrefillJob, SamplingParams
from kvcentric.engine.service.coreshare import COMPUTING, IDLE_AFTER_NS, SLOT, CoreShare
from kvcentric.engine.service.node import ModelThread
from kvcentric.engine.cores.prefill import PrefillEngine

LENGTHS = (9, 30, 17, 44, 5)


def job(index: int, length: int) -> PrefillJob:
    return PrefillJob(request_id=f"r{index}", token_ids=prompt(length, offset=7 * index),
                      sampling=SamplingParams(max_tokens=4, temperature=0.0), decode_id="", decode_kv_addr="")


def engine() -> PrefillEngine:
    runner = make_runner(num_blocks=128, block_size=4)
    return PrefillEngine(runner, make_pool(runner), BlockHasher("sha256_cbor", 4), 16)


def finish(prefill: PrefillEngine, chunk, token, firsts: dict, kv: dict) -> None:
    prefill.update(chunk)
    if chunk.last:
        work = chunk.work
        firsts[work.request_id] = token
        kv[work.request_id] = torch.stack([torch.stack(prefill.runner.layer_kv(layer, work.blocks, 0, work.num_tokens))
                                           for layer in range(prefill.runner.config.num_layers)])
        prefill.complete(work)
        prefill.finish(work)


def alone() -> tuple[dict, dict]:
    prefill, firsts, kv = engine(), {}, {}
    for index, length in enumerate(LENGTHS):
        prefill.submit(job(index, length))
    while chunks := prefill.schedule_step(0):
        finish(prefill, chunks[0], prefill.execute(chunks[0]), firsts, kv)
    return firsts, kv


async def two_threads(prefill: PrefillEngine, model: ModelThread) -> tuple[dict, dict, int]:
    """Both threads take chunks while there are any, as the prefill service's two step loops do."""
    firsts, kv, together = {}, {}, 0

    async def loop(lane: bool) -> None:
        nonlocal together
        run = model.run_lane if lane else model.run
        while chunk := prefill.schedule():
            prefill.computing.add(chunk.work.request_id)
            together += len(prefill.computing) == 2
            token = await run(prefill.execute, chunk)
            prefill.computing.discard(chunk.work.request_id)
            finish(prefill, chunk, token, firsts, kv)

    await asyncio.gather(loop(False), loop(True))
    return firsts, kv, together


def with_lane(tmp_path, peer_computing: bool) -> tuple[ModelThread, CoreShare]:
    """A prefill instance's model thread with a lane, beside a decode instance computing or idle."""
    peer = CoreShare(tmp_path, "decode-0", 1, cores=2)
    model = ModelThread("prefill", 1, CoreShare(tmp_path, "prefill-0", 1, cores=2, takes=True))
    model.add_lane("prefill")
    if peer_computing:
        peer.begin()
    else:
        time.sleep(2 * IDLE_AFTER_NS / 1e9)
    return model, peer


def test_prompts_on_both_threads_at_once_get_what_each_gets_alone(tmp_path):
    model, peer = with_lane(tmp_path, peer_computing=False)
    prefill = engine()
    prefill.runner.model.look = model.refresh  # the lane's looks
    for index, length in enumerate(LENGTHS):
        prefill.submit(job(index, length))
    try:
        firsts, kv, together = asyncio.run(two_threads(prefill, model))
    finally:
        model.close()
        peer.close()
    expected_firsts, expected_kv = alone()
    assert firsts == expected_firsts
    for request, each in expected_kv.items():
        torch.testing.assert_close(kv[request], each, atol=1e-5, rtol=1e-4)
    assert together > 0 and model.lane is not None and model.lane.calls > 0
    assert not prefill.running and not prefill.sending and not prefill.queue


def test_the_scheduler_never_hands_out_a_prompt_being_computed():
    prefill = engine()
    prefill.submit(job(0, 40))  # three chunks of 16
    prefill.submit(job(1, 9))
    first = prefill.schedule()
    assert first is not None and first.work.request_id == "r0"
    prefill.computing.add("r0")
    second = prefill.schedule()
    assert second is not None and second.work.request_id == "r1"  # not r0's next chunk
    prefill.computing.add("r1")
    assert prefill.schedule() is None
    assert [c.work.request_id for c in prefill.schedule_step(64)] == []
    prefill.computing.clear()
    again = prefill.schedule()
    assert again is not None and again.work.request_id == "r0"  # the prompt in progress comes first again


def test_the_instance_computes_until_both_threads_end_and_the_lane_waits_for_a_core(tmp_path):
    """The decode instance holds its core: the lane's pass waits at its first look until the model thread's call
    ends, and the slot says computing until the lane's ends too."""
    model, peer = with_lane(tmp_path, peer_computing=True)
    slot = tmp_path / "prefill-0.cores"
    seen: list[tuple[str, int]] = []

    def computing() -> int:
        return SLOT.unpack(slot.read_bytes()[:SLOT.size])[COMPUTING]

    def main_part() -> str:
        time.sleep(0.1)
        seen.append(("main ends", computing()))
        return "a"

    def lane_part() -> str:
        seen.append(("lane starts", computing()))
        return "b"

    async def both():
        main = asyncio.ensure_future(model.run(main_part))
        await asyncio.sleep(0.02)  # the model thread's call has begun
        return await asyncio.gather(main, model.run_lane(lane_part))

    try:
        assert asyncio.run(both()) == ["a", "b"]
        assert computing() == 0
    finally:
        model.close()
        peer.close()
    assert seen == [("main ends", 1), ("lane starts", 1)]  # the lane waited for the core of the model thread
    assert model.lane is not None and model.lane.waits == 1 and model.calls == 0


def test_a_lane_on_the_instances_own_cores_takes_one_from_the_model_thread_while_it_computes():
    """A colocated instance (no core share) of two torch threads: its model thread computes on both while the lane
    is idle, on one from its first look after the lane begins, and on both again once the lane ends."""
    model = ModelThread("colocated", 2)
    model.add_lane("colocated")
    lane_began, lane_may_end, lane_ended = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, int] = {}

    def main_part() -> None:
        seen["alone"] = torch.get_num_threads()
        assert lane_began.wait(10)
        model.refresh()  # a look within the step (`LlamaModel.look`)
        seen["beside the lane"] = torch.get_num_threads()
        lane_may_end.set()
        assert lane_ended.wait(10)
        model.refresh()
        seen["after the lane"] = torch.get_num_threads()

    def lane_part() -> None:
        lane_began.set()
        seen["lane"] = torch.get_num_threads()
        model.refresh()  # the lane's own looks change nothing
        assert lane_may_end.wait(10)

    async def both() -> None:
        main = asyncio.ensure_future(model.run(main_part))
        await asyncio.sleep(0.05)
        await model.run_lane(lane_part)
        lane_ended.set()
        await main

    try:
        asyncio.run(both())
    finally:
        model.close()
    assert seen == {"alone": 2, "lane": 1, "beside the lane": 1, "after the lane": 2}
    assert model.lane is not None and model.lane.calls == 1 and model.calls == 0
    assert model.stats() == {"lane_calls": 1, "lane_waits": 0}
