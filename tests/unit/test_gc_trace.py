"""`bench/serving/gc_trace/sitecustomize.py` times the full collections of kvcentric services (`bench_gc_pauses.py`) and
of no other process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TRACER = Path(__file__).resolve().parents[2] / "bench" / "serving" / "gc_trace"
COLLECT = "import gc; gc.collect(0); gc.collect(2); gc.collect(2)\n"


def run(script: Path, trace: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(TRACER), "KVC_GC_TRACE": str(trace)}
    subprocess.run([sys.executable, str(script), "gateway", "--port", "0"], env=env, check=True, timeout=60)


def test_a_service_process_full_collections_are_timed_and_other_processes_are_not(tmp_path):
    service = tmp_path / "kvcentric" / "__main__.py"
    other = tmp_path / "other.py"
    service.parent.mkdir()
    service.write_text(COLLECT)
    other.write_text(COLLECT)
    trace = tmp_path / "gc.txt"
    run(other, trace)
    assert not trace.exists()
    run(service, trace)
    lines = [line.split() for line in trace.read_text().splitlines()]  # the two asked for, and one at exit
    assert len(lines) >= 2 and all(command == "gateway" and float(ms) >= 0 for _, ms, command in lines), lines
