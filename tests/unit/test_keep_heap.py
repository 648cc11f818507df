"""`keep_heap`: glibc's malloc keeps a model step's freed activations for the next step instead of unmapping them,
so the next step's allocations land in pages already mapped (no minor page faults). Each case runs in a process of
its own: the setting is process-wide and would outlive the test."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

STEPS = """
import json, resource, sys, torch
from kvcentric.runtime.service import keep_heap
kept = keep_heap()
def step():  # a step's activations: two of `small`'s gate|up at 2048 rows (23 MB each) alive at once, then freed
    live = [torch.ones(2048, 2816) for _ in range(2)]
    del live
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def run_steps(keep: str) -> dict:
    env = {"KVC_MALLOC_KEEP": keep, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", STEPS], env={**env, "PYTHONPATH": ":".join(sys.path)},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_steps_after_the_first_fault_on_no_page_with_the_heap_kept_and_on_every_page_without():
    kept, unkept = run_steps("1"), run_steps("0")
    assert kept["kept"] and not unkept["kept"]
    # ten steps of 2 x 23 MB: as is, glibc maps them afresh (11,264 pages a step) in most processes and adapts
    # its thresholds in some (1,700 a step); with the heap kept about 560 a step (torch's own small buffers)
    assert kept["faults"] < 10 * 1_000
    assert unkept["faults"] > 2 * kept["faults"]


def test_every_service_keeps_its_heap_but_an_engine_on_a_cuda_device():
    from kvcentric.engine.config import EngineConfig
    from kvcentric.runtime.service import heap_kept_for

    assert heap_kept_for(EngineConfig())
    assert heap_kept_for(object())  # a service with no device: the gateway, the conductor, kvs-meta
    assert not heap_kept_for(EngineConfig(device="cuda"))
    assert not heap_kept_for(EngineConfig(device="cuda:1"))
