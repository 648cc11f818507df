"""Loaded at start-up by every Python process that has this directory on PYTHONPATH (`bench_gc_pauses.py` puts it
there for `kvcentric up`'s children): appends one line per full (generation 2) collection of a kvcentric
service to $KVC_GC_TRACE: wall time at its end, its duration in ms, and the service's command."""

import gc
import os
import sys
import time

_trace = os.environ.get("KVC_GC_TRACE", "")
_began: list[float] = []
_MAIN = os.path.join("kvcentric", "__main__.py")


def _timed(phase: str, info: dict) -> None:
    # sys.argv is not set yet when this module is imported: the process is told apart at each collection
    if info["generation"] != 2 or len(sys.argv) < 2 or not sys.argv[0].endswith(_MAIN):
        return
    if phase == "start":
        _began[:] = [time.perf_counter()]
    elif _began:
        with open(_trace, "a") as out:
            out.write(f"{time.time():.4f} {1000 * (time.perf_counter() - _began[0]):.2f} {sys.argv[1]}\n")


if _trace:
    gc.callbacks.append(_timed)
