"""Cores lent between the engine instances of one machine (`kvcentric.engine.service.coreshare`): which threads a
model call may use, read from the slot files of the instances beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from kvcentric.engine.service.coreshare import IDLE_AFTER_NS, RESCAN_NS, RESUMES_NS, SLOT, CoreShare, Slot


@pytest.fixture
def pair(tmp_path):
    """A prefill and a decode instance of one thread each on a 2-core machine."""
    prefill = CoreShare(tmp_path, "prefill-0", 1, cores=2, takes=True)
    decode = CoreShare(tmp_path, "decode-0", 1, cores=2)
    yield prefill, decode
    prefill.close()
    decode.close()


def later(ns: int = 0) -> int:
    return time.monotonic_ns() + ns


def test_an_instance_idle_for_longer_than_idle_after_lends_its_threads(pair):
    prefill, decode = pair
    decode.begin()
    decode.end()
    assert prefill.threads(now_ns=later()) == 1  # it has only just ended a step: the next may follow at once
    assert prefill.threads(now_ns=later(IDLE_AFTER_NS + 1_000_000)) == 2


def test_an_instance_in_a_model_call_keeps_its_threads(pair):
    prefill, decode = pair
    decode.begin()
    assert prefill.threads(now_ns=later(IDLE_AFTER_NS * 10)) == 1
    decode.end()


def test_a_paused_instance_lends_at_once_and_is_given_back_its_core_a_layer_before_it_resumes(pair):
    prefill, decode = pair
    decode.begin()
    decode.end()
    resumes = later(40_000_000)
    decode.pause(resumes)
    assert prefill.threads(margin_ns=5_000_000, now_ns=resumes - 30_000_000) == 2
    assert prefill.threads(margin_ns=5_000_000, now_ns=resumes - 4_000_000) == 1  # its step starts within a layer
    decode.begin()  # it computes again: the pause is over
    assert decode.mine.read()[RESUMES_NS] == 0
    decode.end()


def test_threads_never_exceed_the_usable_cores(tmp_path):
    shares = [CoreShare(tmp_path, f"e{i}", 2, cores=3) for i in range(3)]
    try:
        assert shares[0].threads(now_ns=later(IDLE_AFTER_NS * 2)) == 3
    finally:
        for share in shares:
            share.close()


def test_two_instances_never_borrow_the_same_idle_core(tmp_path):
    """Four instances of one thread on two cores (`up --prefill 2 --decode 2`): the first to compute takes the
    idle cores, and the next ones compute on their own threads only, as without lending."""
    shares = [CoreShare(tmp_path, name, 1, cores=2) for name in ("prefill-0", "prefill-1", "decode-0", "decode-1")]
    try:
        time.sleep(IDLE_AFTER_NS / 1e9 * 2)
        assert shares[2].begin() == 2
        assert shares[3].begin() == 1  # decode-0 holds both cores: 3 threads, not 4
        assert shares[0].threads() == 1
        shares[2].end()
        shares[3].end()
    finally:
        for share in shares:
            share.close()


def test_a_call_that_may_not_borrow_runs_on_its_own_threads_and_holds_them(pair):
    """A calibration times the instance alone: its own threads, however idle the others are; the others see
    its core held."""
    prefill, decode = pair
    time.sleep(IDLE_AFTER_NS / 1e9 * 2)
    assert decode.begin(borrow=False) == 1
    assert prefill.threads() == 1
    decode.end()
    assert decode.lent_calls == 0


def test_a_slot_whose_process_is_gone_is_dropped_at_the_next_rescan(tmp_path):
    share = CoreShare(tmp_path, "prefill-0", 1, cores=2, takes=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    (tmp_path / "decode-0.cores").write_bytes(SLOT.pack(int(dead.stdout), 1, 0, 0, 1, 0, 0, 0))
    try:
        assert share.threads(now_ns=later(IDLE_AFTER_NS * 2)) == 1  # its pid is not alive: not a peer
        assert not share.peers
    finally:
        share.close()


def test_an_instance_that_comes_later_is_seen_within_a_rescan(tmp_path):
    prefill = CoreShare(tmp_path, "prefill-0", 1, cores=2, takes=True)
    now = later()
    assert prefill.threads(now_ns=now) == 1
    decode = CoreShare(tmp_path, "decode-0", 1, cores=2)
    try:
        assert prefill.threads(now_ns=now + 1) == 1  # not listed again yet
        assert prefill.threads(now_ns=now + RESCAN_NS + IDLE_AFTER_NS) == 2
    finally:
        prefill.close()
        decode.close()


def test_closing_removes_the_slot_and_a_closed_share_computes_on_its_own_threads(pair, tmp_path):
    prefill, decode = pair
    decode.close()
    assert not (tmp_path / "decode-0.cores").exists()
    assert decode.begin() == 1
    decode.end()  # no error once closed
    prefill.rescan(later())
    assert not prefill.peers


def test_a_file_too_short_to_be_a_slot_is_skipped(tmp_path):
    (tmp_path / "junk.cores").write_bytes(b"x")
    share = CoreShare(tmp_path, "prefill-0", 1, cores=2, takes=True)
    try:
        assert share.threads(now_ns=later()) == 1
    finally:
        share.close()
    with pytest.raises(ValueError, match="not a slot"):
        Slot(tmp_path / "junk.cores")


CHILD = textwrap.dedent("""
    import sys, time, torch
    from kvcentric.engine.service.coreshare import CoreShare, IDLE_AFTER_NS
    from kvcentric.engine.service.node import ModelThread, serial_elsewhere

    serial_elsewhere()
    peer = CoreShare(sys.argv[1], "decode-0", 1, cores=2)
    model = ModelThread("prefill", 1, CoreShare(sys.argv[1], "prefill-0", 1, cores=2, takes=True))
    import asyncio
    seen = []
    def layer_by_layer():
        seen.append(torch.get_num_threads())
        peer.begin()              # the decode instance starts a step while this call runs
        model.refresh()           # between two layers
        seen.append(torch.get_num_threads())
        return seen
    def alone():
        model.refresh()           # a call that may not borrow takes no core between layers either
        return torch.get_num_threads()
    time.sleep(IDLE_AFTER_NS / 1e9 * 2)
    print(*asyncio.run(model.run(layer_by_layer)), model.share.lent_calls)
    peer.end()
    time.sleep(IDLE_AFTER_NS / 1e9 * 2)
    print(asyncio.run(model.run(alone, borrow=False)), model.share.lent_calls)
    model.close()
""")


def test_a_model_call_runs_on_lent_threads_and_gives_them_back_between_layers(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, check=True)
    lent, alone = done.stdout.splitlines()
    assert lent.split() == ["2", "1", "1"]  # lent at the start, given back at the next layer, one lent call
    assert alone.split() == ["1", "1"]  # borrow=False (a calibration): its own thread, though the peer is idle
    assert [p.name for p in tmp_path.iterdir()] == ["decode-0.cores"]  # the model thread's slot left with it
    assert os.path.exists(tmp_path)


def test_only_a_computing_prefill_with_prompts_queued_makes_a_decode_pace_itself(tmp_path):
    decode = CoreShare(tmp_path, "decode-0", 1, cores=2)
    other_decode = CoreShare(tmp_path, "decode-1", 1, cores=2)
    prefill = CoreShare(tmp_path, "prefill-0", 1, cores=2, takes=True)
    try:
        decode.rescan(later())
        other_decode.waiting(5)
        other_decode.begin()
        assert not decode.taker_behind(2)  # a decode beside it is no reason to slow down
        prefill.waiting(1)
        prefill.begin()
        assert not decode.taker_behind(2)  # one prompt behind: the decode's tokens free the next request
        prefill.waiting(2)
        assert decode.taker_behind(2)
        prefill.end()
        assert not decode.taker_behind(2)
    finally:
        for share in (decode, other_decode, prefill):
            share.close()


def test_a_paced_decode_waits_out_its_period_and_says_when_it_resumes(tmp_path):
    import asyncio

    from kvc_decode.service import PACE_BEHIND
    from kvcentric.engine.service.steps import Pacer

    decode = CoreShare(tmp_path, "decode-0", 1, cores=2)
    prefill = CoreShare(tmp_path, "prefill-0", 1, cores=2, takes=True)
    pacer = Pacer(decode, lend_pace_s=0.05, pace_s=lambda: 0.05, behind=PACE_BEHIND)
    try:
        decode.rescan(later())

        async def step_then_pace() -> float:
            started = time.perf_counter()
            await pacer.pace(started)
            return time.perf_counter() - started

        assert asyncio.run(step_then_pace()) < 0.02  # no prefill computing: the next step follows at once
        prefill.waiting(3)
        prefill.begin()
        assert asyncio.run(step_then_pace()) >= 0.049
        assert decode.mine.read()[RESUMES_NS] > 0  # it said when it resumes
        prefill.end()
    finally:
        decode.close()
        prefill.close()


def test_with_a_relative_slo_a_decode_paces_at_0_8_of_its_own_slo_where_that_is_longer_than_lend_pace_s():
    """A step of 10 ms unloaded: 5x is under the 0.1 s floor, so --lend-pace-s (80 ms) holds; a step of 60 ms:
    0.8 x 5 x 60 ms = 240 ms; an absolute SLO, or no measured model yet: --lend-pace-s as `up` set it."""
    from types import SimpleNamespace

    from kvc_decode.service import DecodeService
    from kvcentric.core.costmodel import CostModel

    def pace(step_s: float | None, tbt_slo_s: float = 0.0) -> float:
        cost = CostModel((0.0, 0.0, 0.0, 0.0), (step_s, 0.0, 0.0), 1) if step_s is not None else None
        running = SimpleNamespace(state="running", context_tokens=300)
        service = SimpleNamespace(config=SimpleNamespace(lend_pace_s=0.08, tbt_slo_s=tbt_slo_s, tbt_slo_factor=5.0),
                                  engine=SimpleNamespace(cost=cost, requests={"r": running}))
        return DecodeService.pace_s(service)

    assert pace(0.01) == pytest.approx(0.08)
    assert pace(0.06) == pytest.approx(0.24)
    assert pace(0.06, tbt_slo_s=0.1) == pace(None) == 0.08


BITS = textwrap.dedent("""
    import torch
    from kvcentric.engine.model.runner import ModelRunner
    from kvcentric.model.config import preset

    runner = ModelRunner(preset("small"), 256, 16, 0, "float32")
    looks = []
    def look():  # a core taken or given back at every look, as lending does within a call
        looks.append(1)
        torch.set_num_threads(1 + len(looks) % 2)
    logits = {}
    for threads in (1, 2, "looks"):
        runner.model.look = look if threads == "looks" else None
        torch.set_num_threads(1 if threads == "looks" else threads)
        prompts = [[(i * 37 + s) % 256 for i in range(n)] for s, n in ((0, 7), (1, 300), (2, 600))]
        tables = [list(range(b, b + (len(p) + 16) // 16 + 1)) for b, p in zip((0, 40, 80), prompts)]
        first = [runner.prefill(p, t, 0) for p, t in zip(prompts, tables)]
        step = runner.decode([int(f.argmax()) for f in first], [len(p) for p in prompts], tables)
        logits[threads] = [*first, step]
    def close(a, b):  # within fp32 rounding, with the same greedy token
        return bool(torch.allclose(a, b, rtol=1e-5, atol=1e-5) and torch.equal(a.argmax(-1), b.argmax(-1)))
    invariant = all(torch.equal(a, b) for a, b in zip(logits[1], logits[2]))  # the CPU's GEMMs, 1 thread or 2
    print(all(close(a, b) for a, b in zip(logits[1], logits[2])),
          all(torch.equal(a, b) or (not invariant and close(a, b)) for a, b in zip(logits[1], logits["looks"])),
          len(looks), invariant)
""")


def test_lent_threads_change_no_bit_of_the_logits():
    """A call's thread count depends on what the instances beside it do, and changes at the model's looks (three
    a layer, one more for each further 512 rows of the MLP); its tokens must not. Bit for bit where the CPU's
    GEMMs give the same bits on 1 and 2 threads (the AMD EPYC VM of 2026-11-26); where they do not (an Intel Xeon
    VM of 2026-11-27: MKL splits the reduction of some shapes over 2 threads, and prefill logits came 1 ulp
    apart with or without oneDNN and our kernels), within fp32 rounding and with the same greedy tokens."""
    done = subprocess.run([sys.executable, "-c", BITS], capture_output=True, text=True, timeout=300, check=True)
    layers = 8  # `small`
    looks = 3 * 3 * layers + layers + 3 * layers  # 3 prompts, the 600-token one's MLP in 2 blocks, 1 decode step
    assert done.stdout.split()[:3] == ["True", "True", str(looks)]
