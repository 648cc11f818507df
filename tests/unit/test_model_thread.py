"""The model thread owns the process's only parallel torch team (`kvcentric.engine.service.node.ModelThread`).

Run in a child interpreter: the thread counts it sets are process-wide state."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import threading
    import torch
    from kvcentric.engine.service.node import ModelThread, serial_elsewhere

    serial_elsewhere()
    model = ModelThread("test", 2)
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    print(torch.get_num_threads(), model.call(torch.get_num_threads), later[0])
    handed_over = ModelThread("next", model.threads)  # a role change: the next service's thread
    print(torch.get_num_threads(), handed_over.call(torch.get_num_threads))
""")


def test_the_model_thread_computes_in_parallel_and_every_other_thread_serially():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    first, second = done.stdout.split("\n")[:2]
    assert first.split() == ["1", "2", "1"]  # event loop's thread, model thread, a thread started later
    assert second.split() == ["1", "2"]


def test_in_a_shared_process_the_model_thread_still_takes_its_own_count():
    child = "import torch\nfrom kvcentric.engine.service.node import ModelThread\n" \
            "torch.set_num_threads(2)\nm = ModelThread('t', 1)\nprint(m.call(torch.get_num_threads))"
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["1"]


LENT = textwrap.dedent("""
    import concurrent.futures
    import torch
    from kvcentric.engine.service.node import ModelThread, serial_elsewhere
    from kvcentric.engine.model.pools import serial_workers

    serial_elsewhere()
    model = ModelThread("prefill", 1)
    model.call(model.use, 2)  # a core lent to it, as `ModelThread.refresh` takes one within a call
    plain = concurrent.futures.ThreadPoolExecutor(1).submit(torch.get_num_threads).result()
    serial = serial_workers(1, "host-write").submit(torch.get_num_threads).result()
    print(model.call(torch.get_num_threads), plain, serial)
""")


def test_a_worker_started_while_the_model_thread_computes_on_lent_cores_still_computes_serially():
    # torch hands a new thread the count set last anywhere: a plain worker started now would make a second
    # OpenMP team, and libgomp would put the model thread's team to sleep between its ops (`engine/model/pools.py`)
    done = subprocess.run([sys.executable, "-c", LENT], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["2", "2", "1"]  # the model thread, a plain worker, a serial worker


async def test_a_call_handed_to_an_idle_thread_has_begun_when_the_hand_off_returns():
    """`Handover`: the event loop waits for an idle thread to take the call (and the GIL), not for a busy one."""
    import asyncio
    import concurrent.futures
    import threading
    import time

    from kvcentric.engine.service.node import Handover

    executor = concurrent.futures.ThreadPoolExecutor(1)
    executor.submit(int).result()  # the thread is up and idle (its start would hand over the GIL by itself)
    handover = Handover(executor, wait_s=30.0)
    begun, release = threading.Event(), threading.Event()

    def blocking(value):
        begun.set()
        release.wait(30)
        return value

    first = handover(blocking, 1)
    assert begun.is_set()  # the thread was idle: the hand-off returned once it had begun
    started = time.perf_counter()
    second = handover(lambda: 2)
    assert time.perf_counter() - started < 10  # busy: queued behind the first, not waited for
    release.set()
    assert await first == 1 and await second == 2

    def failing():
        raise ValueError("the step failed")

    try:
        await handover(failing)
    except ValueError as exc:
        assert str(exc) == "the step failed"
    else:
        raise AssertionError("the call's error was lost")
    assert handover.handed == handover.ended == 3
    assert await asyncio.wait_for(handover(lambda: 4), 30) == 4  # idle again after an error
    executor.shutdown()
